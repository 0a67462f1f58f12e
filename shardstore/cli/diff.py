"""``shardstore diff A B``: which tensors and values differ, and by how much.

Exit code 0 when the checkpoints hold the same names with the same values, 1 when they differ
(like ``diff``), 2 on an error.
"""

from __future__ import annotations

import argparse
import math

from shardstore.cli._common import add_output, add_storage_options, mib, print_json, progress
from shardstore.inspect import DEFAULT_WINDOW, RegionReader, diff_checkpoints

NAME = "diff"
HELP = "compare two checkpoints: names only in one, tensors that differ and their max abs difference"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("a", metavar="A", help="checkpoint directory or URL")
    parser.add_argument("b", metavar="B", help="checkpoint directory or URL")
    parser.add_argument(
        "--window", type=mib, default=DEFAULT_WINDOW, metavar="MIB",
        help=f"MiB of each tensor compared at a time (default {DEFAULT_WINDOW >> 20})",
    )
    add_output(parser)
    add_storage_options(parser)


def run(args: argparse.Namespace) -> int:
    a = RegionReader(args.a, storage_options=args.storage_options, window=args.window)
    b = RegionReader(args.b, storage_options=args.storage_options, window=args.window)
    total = sum(math.prod(t.shape) * t.itemsize for t in a.index.tensors.values())
    with progress(args, "diff", total) as bar:
        result = diff_checkpoints(a, b, progress=bar)
    if args.json:
        print_json(result.to_dict())
        return 0 if result.identical else 1
    for name in result.only_a:
        print(f"- {name}  (only in A)")
    for name in result.only_b:
        print(f"+ {name}  (only in B)")
    for c in result.changed:
        if c.reason == "shape":
            print(f"~ {c.name}  shape {c.a} -> {c.b}")
        elif c.reason == "dtype":
            print(f"~ {c.name}  dtype {c.a} -> {c.b}, max abs diff {c.max_abs_diff:.6g}")
        else:
            print(f"~ {c.name}  max abs diff {c.max_abs_diff:.6g}")
    for name in result.values_changed:
        print(f"~ {name}  (value)")
    changed = len(result.changed) + len(result.values_changed)
    print(
        f"{'identical' if result.identical else 'different'}: {result.same} same, {changed} changed, "
        f"{len(result.only_a)} only in A, {len(result.only_b)} only in B"
    )
    return 0 if result.identical else 1
