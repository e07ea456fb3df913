"""``kvatlas index dump``: an instance's blocks as etcd holds them, readably (the segment values
are binary: ``index.segments``)."""
from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

from index.keys import validate_instance_id, validate_model
from index.segments import MalformedSegment, decode
from kvatlas.cli import CLIError
from kvatlas.commands._run_dir import block_segments, cluster_access


def add_dump_parser(sub: Any) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        "dump", help="print one instance's blocks as stored in etcd",
        description="Every block segment of one instance (of every model unless --model): the "
                    "segment, its parent, when it was written, then one line per block: "
                    "position, hash and medium.")
    parser.add_argument("--instance", required=True, help="the instance id")
    parser.add_argument("--model", default=None, help="only this model's blocks")
    parser.add_argument("--json", action="store_true", help="print JSON instead of lines")
    parser.set_defaults(func=cmd_dump)
    return parser


async def fetch_segments(args: argparse.Namespace) -> list[dict[str, Any]]:
    layout = cluster_access(args).layout
    prefix = (layout.blocks_prefix(args.model, args.instance) if args.model
              else layout.blocks_prefix())
    kvs = await block_segments(args, prefix)
    out: list[dict[str, Any]] = []
    for kv in kvs:
        try:
            model, instance, seg_id = layout.parse_segment(kv.key)
        except ValueError:
            continue
        if instance != args.instance:
            continue
        doc: dict[str, Any] = {"model": model, "segment": f"{seg_id:016x}"}
        try:
            seg = decode(kv.value)
        except MalformedSegment as exc:
            doc["error"] = str(exc)
        else:
            doc.update(parent=None if seg.parent is None else f"{seg.parent:016x}",
                       written=seg.t,
                       blocks=[[f"{h:016x}", m] for h, m in zip(seg.hashes, seg.media,
                                                                strict=True)])
        out.append(doc)
    return out


def cmd_dump(args: argparse.Namespace) -> int:
    try:
        validate_instance_id(args.instance)
        if args.model is not None:
            validate_model(args.model)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    segments = asyncio.run(fetch_segments(args))
    if args.json:
        print(json.dumps(segments))
        return 0
    if not segments:
        print(f"instance {args.instance} has no blocks in the index"
              + (f" for model {args.model}" if args.model else ""))
        return 0
    total = 0
    for s in segments:
        if "error" in s:
            print(f"{s['model']} segment {s['segment']}: unreadable ({s['error']})")
            continue
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(s["written"]))
        print(f"{s['model']} segment {s['segment']}: {len(s['blocks'])} blocks after "
              f"{s['parent'] or 'the chain start'}, written {when}")
        for i, (h, m) in enumerate(s["blocks"]):
            print(f"  {i:3d}  {h}  {m}")
        total += len(s["blocks"])
    print(f"{total} blocks in {len(segments)} segments")
    return 0
