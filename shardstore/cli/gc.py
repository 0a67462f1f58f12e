"""``shardstore gc ROOT``: apply retention and remove crashed saves' leftovers; a dry run unless --yes.

Deletion is :meth:`CheckpointManager.gc`'s: reference-aware (files a kept incremental step
needs stay), index before data, and only while holding the root's lease, so it refuses to run
beside a live training job that is saving there.
"""

from __future__ import annotations

import argparse
import dataclasses

from shardstore.backends import open_backend
from shardstore.cli._common import add_output, add_storage_options, fail, positive_int, print_json, root_problem
from shardstore.config import INDEX_NAME
from shardstore.manager import CheckpointManager, list_checkpoints

NAME = "gc"
HELP = "delete steps beyond a retention policy and leftovers of crashed saves (dry run unless --yes)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("root", metavar="ROOT", help="manager root holding step-* checkpoints")
    parser.add_argument(
        "--keep-last", type=positive_int, default=None, metavar="N",
        help="keep the N newest committed steps (default: keep every committed step; remove leftovers only)",
    )
    parser.add_argument(
        "--keep-every", type=positive_int, default=None, metavar="N",
        help="with --keep-last, also keep every step divisible by N",
    )
    parser.add_argument("--yes", action="store_true", help="delete (without it, only list what would be deleted)")
    add_output(parser)
    add_storage_options(parser)


@dataclasses.dataclass
class _Plan:
    steps: list[str]  # step directories whose index goes (the step is removed)
    files: int


def _summarize(paths: list[str]) -> _Plan:
    steps = sorted({p.split("/", 1)[0] for p in paths if p.endswith("/" + INDEX_NAME)})
    return _Plan(steps=steps, files=len(paths))


def run(args: argparse.Namespace) -> int:
    if args.keep_every is not None and args.keep_last is None:
        return fail(args, NAME, ValueError("--keep-every needs --keep-last (without it every committed step is kept)"))
    if not list_checkpoints(args.root, args.storage_options):
        backend = open_backend(args.root, args.storage_options)
        try:
            root_problem(backend, single_ok=False)
        finally:
            backend.close()
    with CheckpointManager(
        args.root, keep_last=args.keep_last, keep_every=args.keep_every, storage_options=args.storage_options
    ) as mgr:
        paths = mgr.gc(dry_run=not args.yes)
    plan = _summarize(paths)
    if args.json:
        print_json({"dry_run": not args.yes, "removed_steps": plan.steps, "paths": paths})
        return 0
    verb = "deleted" if args.yes else "would delete"
    for p in paths:
        print(f"{verb}  {p}")
    print(
        f"{verb} {len(plan.steps)} step(s) ({', '.join(plan.steps) or 'none'}) and {plan.files} file(s) in all"
        + ("" if args.yes else "; run again with --yes to delete")
    )
    return 0
