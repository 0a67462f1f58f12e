"""``shardstore import SRC DST``: a safetensors file (or a directory of them) as a checkpoint."""

from __future__ import annotations

import argparse
import dataclasses

from shardstore.cli._common import add_output, add_storage_options, fail, human, print_json, progress
from shardstore.importer import import_safetensors

NAME = "import"
HELP = "write a safetensors file (or a directory of them, e.g. a Hugging Face model) as a checkpoint"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", metavar="SRC", help=".safetensors file, or a directory of them (path or URL)")
    parser.add_argument("checkpoint", metavar="DST", help="checkpoint directory or URL to create")
    parser.add_argument("--add-prefix", default="", metavar="P", help="prepend P to every tensor name (e.g. 'model.')")
    parser.add_argument("--compression", choices=["zstd"], default=None, help="compress frames with zstd")
    parser.add_argument("--threads", type=int, default=0, help="parallel writer threads (default: automatic)")
    parser.add_argument("--overwrite", action="store_true", help="replace a checkpoint already at DST")
    add_output(parser)
    add_storage_options(parser)


def run(args: argparse.Namespace) -> int:
    with progress(args, "import") as bar:
        try:
            result = import_safetensors(
                args.source, args.checkpoint, add_prefix=args.add_prefix, storage_options=args.storage_options,
                progress=bar, compression=args.compression, threads=args.threads, overwrite=args.overwrite,
            )
        except ValueError as e:  # invalid writer options
            return fail(args, NAME, e)
    if args.json:
        print_json(dataclasses.asdict(result))
    else:
        print(f"wrote {result.out}: {result.tensors} tensors, {human(result.bytes)} in {result.seconds:.1f} s")
    return 0
