"""``shardstore cp SRC DST``: copy a checkpoint between any two stores, so that the copy stands alone.

The copy follows the save flow's commit protocol: every data file the index names is streamed
to the destination first (files in parallel, each in bounded parts), and the index is published
last, atomically, so the copy becomes visible only once complete, and a failed copy leaves no
committed checkpoint (and deletes the files it wrote). An incremental checkpoint's index names
files that live in a sibling checkpoint (``FileEntry.base``); those files are copied in and the
index is rewritten with plain local entries, so the copy needs nothing beside it. Bytes are
copied verbatim: every frame keeps the checksum it was written with.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from shardstore.backends import Backend, open_backend, sibling_url
from shardstore.cli._common import add_output, add_storage_options, fail, human, mib, print_json, progress
from shardstore.config import INDEX_NAME, MiB
from shardstore.errors import CheckpointExistsError
from shardstore.index import FileEntry, decode_index, encode_index
from shardstore.progress import Progress, silent
from shardstore.reader import load_index

logger = logging.getLogger(__name__)

NAME = "cp"
HELP = "copy a checkpoint between stores (local, s3://, any fsspec URL); incremental references are copied in"

DEFAULT_PART = 32 * MiB
#: Exit status when ``--verify`` finds the copy damaged (2 is reserved for errors).
EXIT_DAMAGED = 1
DEFAULT_THREADS = 4


@dataclasses.dataclass
class CopyResult:
    """What :func:`copy_checkpoint` copied."""

    src: str
    dst: str
    files: int
    bytes: int
    seconds: float
    materialized: list[str]  # sibling checkpoints whose files were copied in


def _same_place(a: str, b: str) -> bool:
    def norm(u: str) -> str:
        if "://" not in u or u.startswith("file://"):
            return os.path.realpath(u.removeprefix("file://"))
        return u.rstrip("/")

    return norm(a) == norm(b)


def _copy_file(src: Backend, path: str, size: int, dst: Backend, out: str, part: int, bar: Progress) -> None:
    with dst.open_writer(out) as writer:
        pos = 0
        while pos < size:
            n = min(part, size - pos)
            (data,) = src.read_ranges(path, [(pos, n)])
            writer.write(data)
            pos += n
            bar.update(n)


def copy_checkpoint(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    storage_options: dict[str, Any] | None = None,
    dst_storage_options: dict[str, Any] | None = None,
    threads: int = DEFAULT_THREADS,
    part_size: int = DEFAULT_PART,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> CopyResult:
    """Copy the committed checkpoint at ``src`` to ``dst`` (both paths or URLs).

    Args:
        src: source checkpoint.
        dst: destination checkpoint directory or URL.
        storage_options: fsspec options for ``src`` (and ``dst`` unless ``dst_storage_options``).
        dst_storage_options: fsspec options for ``dst``.
        threads: files copied at once.
        part_size: bytes read and written per step (memory is about ``threads * part_size``).
        overwrite: replace a checkpoint committed at ``dst`` (atomically, index last).
        progress: a byte counter to advance.

    Raises:
        CheckpointNotFoundError: ``src`` holds no committed checkpoint.
        CheckpointExistsError: ``dst`` holds one and ``overwrite`` is false.
        ValueError: ``src`` and ``dst`` are the same place.
    """
    t0 = time.perf_counter()
    bar = progress or silent()
    src, dst = os.fspath(src), os.fspath(dst)
    if threads < 1 or part_size < 1:
        raise ValueError("threads and part_size must be positive")
    if _same_place(src, dst):
        raise ValueError(f"source and destination are the same place: {src}")
    sb = open_backend(src, storage_options)
    load_index(sb)  # a clear error for a missing, foreign or unfinished checkpoint
    raw = sb.read_small(INDEX_NAME)  # the exact bytes copied or rewritten below
    index = decode_index(raw, source=f"{sb.url}/{INDEX_NAME}")
    db = open_backend(dst, dst_storage_options if dst_storage_options is not None else storage_options)
    if db.exists(INDEX_NAME) and not overwrite:
        raise CheckpointExistsError(f"{db.url} already holds a committed checkpoint; pass --overwrite to replace it")

    bases: dict[str, Backend] = {}
    jobs: list[tuple[Backend, str, int, str]] = []  # (source backend, path, size, destination path)
    taken: set[str] = set()
    new_files: list[FileEntry] = []
    for f in index.files:
        if f.base is None:
            source, out = sb, f.path
        else:
            if f.base not in bases:
                bases[f.base] = open_backend(sibling_url(src, f.base), storage_options)
            source, out = bases[f.base], f.path
        if out in taken:
            out = f"{f.base}-{f.path}"
        taken.add(out)
        jobs.append((source, f.path, f.size, out))
        new_files.append(FileEntry(path=out, size=f.size))
    total = sum(size for _, _, size, _ in jobs)
    bar.set_total(total)

    written: list[str] = []
    try:
        with ThreadPoolExecutor(threads, "shardstore-cp") as pool:
            futures = [pool.submit(_copy_file, s, p, n, db, out, part_size, bar) for s, p, n, out in jobs]
            errors = []
            for (_, _, _, out), fut in zip(jobs, futures):
                try:
                    fut.result()
                    written.append(out)
                except Exception as e:  # let every file finish, then raise the first failure
                    errors.append(e)
            if errors:
                raise errors[0]
        if bases:
            index.files = new_files
            raw = encode_index(index)
        db.publish(INDEX_NAME, raw, overwrite=overwrite)
    except BaseException:
        try:
            db.delete(written)
        except Exception:  # keep the original failure; the files are an uncommitted leftover
            logger.warning("could not remove the partial copy's files under %s", db.url, exc_info=True)
        raise
    if overwrite:  # drop data files of the checkpoint this copy replaced
        keep = set(taken) | {INDEX_NAME}
        db.delete([p for p in db.list() if p not in keep and p.startswith("data-")])
    result = CopyResult(
        src=sb.url, dst=db.url, files=len(jobs), bytes=total, seconds=round(time.perf_counter() - t0, 3),
        materialized=sorted(bases),
    )
    for b in (sb, db, *bases.values()):
        b.close()
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", metavar="SRC", help="checkpoint directory or URL")
    parser.add_argument("dest", metavar="DST", help="destination directory or URL")
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS, help=f"files copied at once (default {DEFAULT_THREADS})")
    parser.add_argument(
        "--part-size", type=mib, default=DEFAULT_PART, metavar="MIB",
        help=f"MiB read and written per step and thread (default {DEFAULT_PART >> 20})",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace a checkpoint already at DST")
    parser.add_argument(
        "--verify", action="store_true",
        help="then re-read every frame of the copy and check its checksum (exit 1 if damaged)",
    )
    add_output(parser)
    add_storage_options(parser, flag="--src-options", dest="storage_options")
    add_storage_options(parser, flag="--dst-options", dest="dst_storage_options")


def run(args: argparse.Namespace) -> int:
    with progress(args, "cp") as bar:
        try:
            result = copy_checkpoint(
                args.source, args.dest, storage_options=args.storage_options,
                dst_storage_options=args.dst_storage_options, threads=args.threads, part_size=args.part_size,
                overwrite=args.overwrite, progress=bar,
            )
        except ValueError as e:  # same place, bad sizes
            return fail(args, NAME, e)
    report = None
    if args.verify:
        from shardstore.verify import verify_checkpoint

        opts = args.dst_storage_options if args.dst_storage_options is not None else args.storage_options
        report = verify_checkpoint(result.dst, storage_options=opts)
    status = 0 if report is None or report.ok else EXIT_DAMAGED
    if args.json:
        print_json({**dataclasses.asdict(result), **({"verify": report.to_dict()} if report else {})})
        return status
    print(f"copied {result.src} -> {result.dst}: {result.files} files, {human(result.bytes)} in {result.seconds:.1f} s")
    if result.materialized:
        print(f"copied in the files it referenced from {', '.join(result.materialized)}; the copy stands alone")
    if report is not None:
        damaged = ", ".join(report.damaged_tensors + report.damaged_files + report.bad_values)
        print(f"verified the copy: {'OK' if report.ok else 'DAMAGED: ' + damaged}")
    return status
