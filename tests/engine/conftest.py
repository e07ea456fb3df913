"""Engine tests run torch single-threaded (as the engine server does by default): on a small
shared machine OpenMP's spinning threads make every forward many times slower."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _single_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
