"""``shardstore export CKPT OUT``: one safetensors (or torch.save) file, streamed in bounded memory."""

from __future__ import annotations

import argparse

from shardstore.cli._common import add_output, add_storage_options, fail, human, mib, print_json, progress
from shardstore.export import FORMATS, export_checkpoint, parse_dtype
from shardstore.inspect import DEFAULT_WINDOW

NAME = "export"
HELP = "write a checkpoint (any world size) as one safetensors or torch.save file, in bounded memory"

_TORCH_SUFFIXES = (".pt", ".pth")


def _dtype(text: str):
    try:
        return parse_dtype(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory or URL")
    parser.add_argument("out", metavar="OUT", help="output file (safetensors may also go to a URL)")
    parser.add_argument(
        "--format", choices=FORMATS, default=None,
        help="output format (default: torch for a .pt/.pth name, else safetensors)",
    )
    parser.add_argument(
        "--prefix", action="append", default=[], metavar="P",
        help="export only names starting with P (repeatable)",
    )
    parser.add_argument("--strip-prefix", default=None, metavar="P", help="remove P from the start of the names")
    parser.add_argument("--dtype", type=_dtype, default=None, help="cast floating-point tensors (bf16, fp16, fp32...)")
    parser.add_argument(
        "--window", type=mib, default=DEFAULT_WINDOW, metavar="MIB",
        help=f"MiB of tensor data read at a time; memory is a few times this (default {DEFAULT_WINDOW >> 20})",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    add_output(parser)
    add_storage_options(parser)


def run(args: argparse.Namespace) -> int:
    fmt = args.format or ("torch" if args.out.endswith(_TORCH_SUFFIXES) else "safetensors")
    with progress(args, "export") as bar:
        try:
            result = export_checkpoint(
                args.checkpoint, args.out, format=fmt, prefixes=args.prefix, strip_prefix=args.strip_prefix,
                dtype=args.dtype, window=args.window, overwrite=args.overwrite,
                storage_options=args.storage_options, progress=bar,
            )
        except ValueError as e:  # a selection or format the checkpoint cannot satisfy
            return fail(args, NAME, e)
    if args.json:
        print_json(result.to_dict())
        return 0
    print(
        f"wrote {result.out} ({result.format}): {result.tensors} tensors, {human(result.data_bytes)} "
        f"in {result.seconds:.1f} s"
    )
    if result.skipped_values:
        print(f"skipped {len(result.skipped_values)} non-tensor value(s) (safetensors holds tensors only): "
              + ", ".join(result.skipped_values[:5]) + (" ..." if len(result.skipped_values) > 5 else ""))
    return 0
