"""A prefill rank in its own process, for the two-process tests: serves rooms over ZMQ.

Prints ``PORT <n>`` once bound, then ``SENT <room>`` per room. With ``--hang`` it stops after the
decode bootstrapped the first room (to be killed by the test, like a prefill dying mid-transfer).
"""
from __future__ import annotations

import argparse
import asyncio
import sys

from transfer_helpers import fast_config, layout, pool

from transfer.backends.zmq_backend import ZmqSender
from transfer.layout import DTYPES, TensorPageSource


async def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--pages", type=int, default=16)
    ap.add_argument("--rooms", required=True)
    ap.add_argument("--src", required=True)
    ap.add_argument("--hang", action="store_true")
    args = ap.parse_args()
    lay = layout(dtype=DTYPES[args.dtype])
    src = pool(lay, args.pages, args.seed)
    sender = ZmqSender(fast_config(), lay, TensorPageSource(src, lay))
    await sender.start()
    print(f"PORT {sender.port}", flush=True)
    page_ids = [int(x) for x in args.src.split(",")]
    for room in (int(x) for x in args.rooms.split(",")):
        sender.create(room)
        if args.hang:
            await sender.wait_bootstrapped(room)
            print(f"BOOTSTRAPPED {room}", flush=True)
            await asyncio.sleep(3600)
        await sender.send(room, page_ids, first_token=room % 1000, cached_tokens=1)
        print(f"SENT {room}", flush=True)
    await sender.close()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
