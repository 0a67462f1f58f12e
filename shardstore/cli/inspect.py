"""``shardstore inspect CKPT``: every tensor (dtype, shape, chunks, bytes, compression) and value."""

from __future__ import annotations

import argparse

from shardstore.backends import open_backend
from shardstore.cli._common import add_output, add_storage_options, human, print_json, table, when
from shardstore.inspect import summarize
from shardstore.reader import load_index

NAME = "inspect"
HELP = "list a checkpoint's tensors (dtype, shape, chunks, stored bytes, compression) and values"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory or URL")
    parser.add_argument("--prefix", default="", help="show only names starting with this")
    add_output(parser)
    add_storage_options(parser)


def run(args: argparse.Namespace) -> int:
    backend = open_backend(args.checkpoint, args.storage_options)
    try:
        info = summarize(load_index(backend), backend.url)
    finally:
        backend.close()
    info["tensors"] = [t for t in info["tensors"] if t["name"].startswith(args.prefix)]
    info["values"] = [v for v in info["values"] if v["name"].startswith(args.prefix)]
    if args.json:
        print_json(info)
        return 0
    print(f"checkpoint  {info['url']}")
    print(
        f"saved       {when(info['created'])} by {info['world_size']} rank(s); "
        f"{info['files']} data file(s), frame size {human(info['frame_size'])}"
    )
    if info["user"]:
        print(f"metadata    {info['user']}")
    if info["bases"]:
        print(f"references  {', '.join(info['bases'])} (incremental)")
    print(
        f"tensors     {len(info['tensors'])}: {human(info['raw_bytes'])} raw, "
        f"{human(info['stored_bytes'])} stored (ratio {info['ratio']:.2f})"
    )
    if info["tensors"]:
        rows = [
            [t["name"], t["dtype"], "x".join(map(str, t["shape"])) or "scalar", t["chunks"], human(t["stored_bytes"]),
             f"{t['ratio']:.2f}"]
            for t in info["tensors"]
        ]
        print()
        print(table(rows, ["NAME", "DTYPE", "SHAPE", "CHUNKS", "STORED", "RATIO"], right={3, 4, 5}))
    if info["values"]:
        print()
        print(table([[v["name"], v["type"], v["repr"]] for v in info["values"]], ["VALUE", "TYPE", "CONTENT"]))
    return 0
