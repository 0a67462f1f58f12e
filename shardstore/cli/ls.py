"""``shardstore ls ROOT``: the step checkpoints under a manager root, committed or partial."""

from __future__ import annotations

import argparse
import dataclasses

from shardstore.backends import open_backend
from shardstore.cli._common import add_output, add_storage_options, human, print_json, root_problem, table, when
from shardstore.manager import CheckpointInfo, list_checkpoints
from shardstore.reader import load_index

NAME = "ls"
HELP = "list the checkpoints under a root: step, committed or partial, size, world size, time"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("root", metavar="ROOT", help="manager root (holding step-* checkpoints) or one checkpoint")
    add_output(parser)
    add_storage_options(parser)


def _single(root: str, storage_options: dict | None) -> list[CheckpointInfo]:
    """ROOT is one checkpoint rather than a root: describe it as a one-row listing."""
    backend = open_backend(root, storage_options)
    try:
        root_problem(backend, single_ok=True)
        index = load_index(backend)
        return [
            CheckpointInfo(
                step=index.user["step"] if isinstance(index.user.get("step"), int) else None,  # type: ignore[arg-type]
                name=backend.url.rstrip("/").rsplit("/", 1)[-1], url=backend.url, committed=True,
                nfiles=len(index.files) + 1, created=index.created, world_size=index.world_size,
                logical_nbytes=index.stored_nbytes(), raw_nbytes=index.raw_nbytes(),
                added_nbytes=sum(f.size for f in index.files if f.base is None),
                bases=tuple(sorted({f.base for f in index.files if f.base is not None})),
            )
        ]
    finally:
        backend.close()


def run(args: argparse.Namespace) -> int:
    infos = list_checkpoints(args.root, args.storage_options) or _single(args.root, args.storage_options)
    if args.json:
        print_json([dataclasses.asdict(i) for i in infos])
        return 0
    rows = [
        [
            i.name,
            "committed" if i.committed else "partial",
            when(i.created),
            i.world_size if i.world_size is not None else "-",
            human(i.logical_nbytes),
            human(i.added_nbytes),
            ", ".join(i.bases) or "-",
        ]
        for i in infos
    ]
    print(table(rows, ["CHECKPOINT", "STATE", "CREATED", "RANKS", "SIZE", "WRITTEN", "REFERENCES"], right={3, 4, 5}))
    return 0
