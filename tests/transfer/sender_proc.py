"""A prefill rank in its own process, for the two-process tests: serves rooms over ZMQ.

Prints ``PORT <n>`` once bound, then ``SENT <room> <how>`` per room (``how``: ``bytes``, or the
cuda_ipc backend's choice for the decode: ``ipc``/``staged``). With ``--hang`` it stops after the
decode bootstrapped the first room (to be killed by the test, like a prefill dying mid-transfer).
The transfer key, if any, comes from ``$KVATLAS_TRANSFER_KEY`` as in a real prefill.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys

from transfer_helpers import fast_config, layout, pool

from transfer import create_sender
from transfer.base import TRANSFER_KEY_ENV
from transfer.layout import DTYPES, TensorPageSource


async def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--pages", type=int, default=16)
    ap.add_argument("--rooms", required=True)
    ap.add_argument("--src", required=True)
    ap.add_argument("--hang", action="store_true")
    ap.add_argument("--backend", default="zmq", choices=["zmq", "cuda_ipc"])
    ap.add_argument("--device", default="cpu", help="where the source pool lives")
    args = ap.parse_args()
    lay = layout(dtype=DTYPES[args.dtype])
    src = pool(lay, args.pages, args.seed).to(args.device)
    sender = create_sender(args.backend, fast_config(key=os.environ.get(TRANSFER_KEY_ENV)), lay,
                           TensorPageSource(src, lay))
    await sender.start()
    print(f"PORT {sender.rank_address[1]}", flush=True)
    page_ids = [int(x) for x in args.src.split(",")]
    for room in (int(x) for x in args.rooms.split(",")):
        sender.create(room)
        if args.hang:
            await sender.wait_bootstrapped(room)
            print(f"BOOTSTRAPPED {room}", flush=True)
            await asyncio.sleep(3600)
        await sender.send(room, page_ids, first_token=room % 1000, cached_tokens=1)
        how = getattr(sender, "choices", {})
        print(f"SENT {room} {next(iter(how.values())).mode if how else 'bytes'}", flush=True)
    await sender.close()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
