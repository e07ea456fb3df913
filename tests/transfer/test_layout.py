"""Layouts, the tensor page source (zero-copy vs gather) and the pool writer."""
from __future__ import annotations

import pytest
import torch
from transfer_helpers import layout, pool

from transfer.backends._receiver_write import PoolWriter
from transfer.layout import KVLayout, TensorPageSource, intersect


def test_for_tp_splits_heads() -> None:
    lays = [layout(r, 4) for r in range(4)]
    assert [l.heads for l in lays] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert lays[2].pool_shape(10) == (3, 2, 10, 4, 1, 8)
    with pytest.raises(ValueError, match="cannot be split evenly"):
        layout(0, 3)


@pytest.mark.parametrize("kwargs, word", [
    ({"heads": (2, 2)}, "heads"), ({"layers": (0, 9)}, "layers"), ({"dtype": "float7"}, "dtype"),
    ({"page_size": 0}, "page_size"), ({"tp_rank": 2}, "tp_rank"),
])
def test_layout_validation(kwargs: dict, word: str) -> None:
    base = dict(num_layers=3, num_heads=4, head_dim=8, page_size=4, dtype="bfloat16",
                layers=(0, 3), heads=(0, 4), tp_rank=0, tp_size=2)
    with pytest.raises(ValueError, match=word):
        KVLayout(**{**base, **kwargs})


def test_mismatches_name_both_values() -> None:
    a, b = layout(page_size=4), layout(page_size=8, dtype=torch.float32)
    text = "; ".join(a.mismatches(b))
    assert "page_size: this side 4, peer 8" in text
    assert "kv_cache_dtype: this side 'bfloat16', peer 'float32'" in text
    assert layout(0, 2).mismatches(layout(1, 2)) == []


def test_wire_round_trip_and_intersect() -> None:
    lay = layout(1, 2)
    assert KVLayout.from_wire(lay.to_wire()) == lay
    assert intersect((0, 4), (2, 8)) == (2, 4) and intersect((0, 2), (2, 4)) is None


def test_page_source_views_a_run_and_gathers_otherwise() -> None:
    lay = layout()
    src = pool(lay, 16, seed=1)
    ps = TensorPageSource(src, lay)
    run = ps.read_pages([4, 5, 6], (0, 3), (0, 4))
    assert len(run) == 6 and all(t.is_contiguous() for t in run)
    # consecutive pages over all heads share the pool's storage
    assert run[0].data_ptr() == src[0, 0, 4].data_ptr()
    assert torch.equal(run[3], src[1, 1, 4:7])
    scattered = ps.read_pages([9, 2, 7], (1, 3), (1, 3))
    assert len(scattered) == 4
    assert scattered[0].data_ptr() != src[1, 0].data_ptr()
    assert torch.equal(scattered[1], src[1, 1][[9, 2, 7]][:, :, 1:3])
    with pytest.raises(ValueError, match="holds"):
        TensorPageSource(pool(layout(0, 2), 4, 1), layout(0, 2)).read_pages([0], (0, 3), (0, 4))


def test_pool_check_names_shape() -> None:
    with pytest.raises(ValueError, match="shape"):
        TensorPageSource(torch.zeros(3, 2, 5, 4, 4), layout())


@pytest.mark.parametrize("ids", [[3, 4, 5], [7, 1, 5]])
@pytest.mark.parametrize("heads", [(0, 4), (2, 4)])
def test_pool_writer(ids: list[int], heads: tuple[int, int]) -> None:
    lay = layout()
    dst = pool(lay, 8, seed=None)
    before = dst.clone()
    chunk = pool(layout(), len(ids), seed=3)[:, :, :, :, heads[0]:heads[1]]
    tensors = [chunk[l, kv].contiguous() for l in range(3) for kv in (0, 1)]
    PoolWriter(dst, lay).write(ids, (0, 3), heads, tensors)
    assert torch.equal(dst[:, :, ids, :, heads[0]:heads[1]], chunk)
    untouched = [p for p in range(8) if p not in ids]
    assert torch.equal(dst[:, :, untouched], before[:, :, untouched])
    if heads != (0, 4):
        assert torch.equal(dst[:, :, ids, :, :heads[0]], before[:, :, ids, :, :heads[0]])


from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from transfer.backends._sender_core import plan_chunks  # noqa: E402


@given(st.integers(1, 300), st.integers(0, 10), st.integers(1, 40), st.integers(1, 4096),
       st.integers(4096, 1 << 20))
def test_plan_chunks_cover_every_cell_once(pages: int, l0: int, nl: int, page_bytes: int,
                                           chunk: int) -> None:
    plan = plan_chunks(pages, (l0, l0 + nl), page_bytes, chunk)
    cells = [(l, p) for (a, b), s, e in plan for l in range(a, b) for p in range(s, e)]
    assert sorted(cells) == [(l, p) for l in range(l0, l0 + nl) for p in range(pages)]
    for (a, b), s, e in plan:  # never above the target unless one page of one layer is
        assert (b - a) * (e - s) * page_bytes <= max(chunk, page_bytes)
    if pages * page_bytes >= chunk:  # big transfers: every frame is at least half a chunk
        assert all(b - a == 1 for (a, b), _, _ in plan)
