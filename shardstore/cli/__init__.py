"""``shardstore`` command line: one module per verb in this package.

Each verb module defines ``NAME`` (the verb), ``HELP`` (one line), ``add_arguments(parser)`` and
``run(args) -> int``. Errors derived from :class:`~shardstore.ShardstoreError` (and missing
files) print as one line on stderr with exit code 2; ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import pkgutil
import sys

from shardstore.errors import ShardstoreError


def _verbs() -> list:
    mods = []
    for info in pkgutil.iter_modules(__path__):
        if info.name.startswith("_"):
            continue
        mods.append(importlib.import_module(f"{__name__}.{info.name}"))
    return sorted(mods, key=lambda m: m.NAME)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardstore", description="Distributed checkpoints for PyTorch.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    for mod in _verbs():
        p = sub.add_parser(mod.NAME, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.WARNING, format="%(message)s")
    try:
        return int(args._run(args) or 0)
    except (ShardstoreError, FileNotFoundError, PermissionError) as e:
        if args.debug:
            raise
        print(f"shardstore {args.verb}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. `shardstore ls --json | head`: the reader went away
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0


if __name__ == "__main__":
    sys.exit(main())
