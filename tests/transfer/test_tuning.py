"""The opt-in host allocator tuning: it is process-wide, so it runs in a child process.

The child applies it before any thread starts (as a worker must), then checks what it is for:
frames that ZMQ's I/O thread allocates and the main thread frees are served from the same mapped
heap again, so a second burst of transfers page-faults far less than the first."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent("""
    import json, resource, sys
    sys.path.insert(0, sys.argv[1])
    from transfer.tuning import tune_host_allocator
    ok = tune_host_allocator()
    import zmq
    ctx = zmq.Context(1)
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    port = push.bind_to_random_port("tcp://127.0.0.1")
    pull.connect(f"tcp://127.0.0.1:{port}")
    payload = bytes(1 << 20)

    def burst():
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(96):  # 96 MiB in flight: more than one 64 MiB arena heap
            push.send(payload, copy=False)
        frames = [pull.recv(copy=False) for _ in range(96)]
        assert all(len(f) == len(payload) for f in frames)
        del frames
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    first = burst()
    again = [burst() for _ in range(3)]
    push.close(0); pull.close(0); ctx.term()
    print(json.dumps({"ok": ok, "first": first, "again": again}))
""")


def test_tuned_process_reuses_received_frame_memory() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD, str(ROOT)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["ok"] is True, "glibc refused the mallopt settings"
    # 96 MiB of fresh frames fault in at least ~24k pages (4 KiB) the first time (fewer with huge
    # pages); re-used heap memory faults almost nothing.
    assert result["first"] > 0
    assert max(result["again"]) * 4 < result["first"], result
