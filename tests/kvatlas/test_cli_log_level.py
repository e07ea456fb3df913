"""The command line's own parsing: --log-level anywhere and in any case, as sglang-router's
command lines give it."""
from __future__ import annotations

import subprocess
import sys

import pytest

from kvatlas.etcd_proc import free_port


@pytest.mark.parametrize("flag", [["--log-level", "warn"], ["--log-level=debug"],
                                  ["--log-level", "INFO", "--log-level", "error"]])
def test_log_level_after_the_command(flag: list[str]) -> None:
    dead = f"127.0.0.1:{free_port()}"
    res = subprocess.run([sys.executable, "-m", "kvatlas", "instances", *flag, "--etcd", dead,
                          "--etcd-timeout", "1"], capture_output=True, text=True, timeout=60)
    # Parsed: the command ran and failed on etcd, not on its arguments.
    assert res.returncode == 2 and "etcd unreachable" in res.stderr, res.stderr
    assert "unrecognized arguments" not in res.stderr


def test_a_bad_log_level_is_named() -> None:
    res = subprocess.run([sys.executable, "-m", "kvatlas", "instances", "--log-level", "loud"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "--log-level: invalid choice: 'LOUD'" in res.stderr
