"""What several commands share: stopping on signals. The etcd flags are
``index.access.ClusterAccess.add_cli_args`` (with ``--run-dir``: ``_run_dir``)."""
from __future__ import annotations

import asyncio
import signal


def stop_on_signals() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT (call inside the running loop): what a serving
    command waits on before it closes what it started."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop
