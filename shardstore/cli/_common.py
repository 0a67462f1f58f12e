"""Helpers shared by the verb modules: common options, output as text or JSON, sizes, progress.

Not a verb (the leading underscore keeps it out of verb discovery).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from typing import Any

from shardstore.backends import Backend
from shardstore.config import INDEX_NAME
from shardstore.errors import CheckpointNotFoundError
from shardstore.progress import Progress


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def add_output(parser: argparse.ArgumentParser) -> None:
    """``--json``: one JSON document on stdout instead of text, no progress bar."""
    parser.add_argument("--json", action="store_true", help="print one JSON document (for scripts); no progress bar")


def add_storage_options(parser: argparse.ArgumentParser, *, flag: str = "--storage-options", dest: str = "storage_options") -> None:
    """A JSON object of fsspec/S3 options (endpoint, credentials) for URLs."""
    parser.add_argument(
        flag, dest=dest, type=_json_object, default=None, metavar="JSON",
        help='fsspec options for URLs, e.g. \'{"endpoint_url": "http://minio:9000"}\' '
        "(S3 credentials and endpoint also come from the usual AWS_* variables)",
    )


def positive_int(text: str) -> int:
    """argparse type: an integer of at least 1 (counts, thread numbers)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def mib(text: str) -> int:
    """An argparse type: a positive size in MiB, returned in bytes."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of MiB: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError("must be positive")
    return int(value * (1 << 20))


def progress(args: argparse.Namespace, desc: str, total: int | None = None) -> Progress:
    """A progress bar on stderr, off with ``--json``."""
    return Progress(total, desc, enabled=not getattr(args, "json", False))


def print_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2, sort_keys=False, default=str)
    sys.stdout.write("\n")


def fail(args: argparse.Namespace, verb: str, error: Exception) -> int:
    """Report a bad request (e.g. a selection that matches nothing) like the dispatcher reports
    a ShardstoreError: one line on stderr, exit code 2; with ``--debug`` re-raise instead."""
    if getattr(args, "debug", False):
        raise error
    print(f"shardstore {verb}: error: {error}", file=sys.stderr)
    return 2


def human(nbytes: int | None) -> str:
    """``1536`` -> ``1.5 KiB``."""
    if nbytes is None:
        return "-"
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def when(seconds: float | None) -> str:
    """Seconds since the epoch as local ``YYYY-mm-dd HH:MM:SS``."""
    if seconds is None:
        return "-"
    return datetime.datetime.fromtimestamp(seconds).strftime("%Y-%m-%d %H:%M:%S")


def table(rows: list[list[str]], header: list[str], *, right: set[int] = frozenset()) -> str:
    """Left/right aligned columns separated by two spaces."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = []
    for r in [header, *rows]:
        cells = [str(c).rjust(w) if i in right else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def root_problem(backend: Backend, *, single_ok: bool) -> None:
    """Explain why ``backend`` holds no ``step-*`` checkpoints (called when a listing found none).

    Returns quietly for a single committed checkpoint when ``single_ok``.

    Raises:
        CheckpointNotFoundError: naming what is there instead.
    """
    files = backend.list()
    if not files:
        raise CheckpointNotFoundError(f"nothing at {backend.url}: the path does not exist or is empty")
    if INDEX_NAME in files:
        if single_ok:
            return
        raise CheckpointNotFoundError(
            f"{backend.url} is a single checkpoint, not a root of step-NNNNNNNNNNNN checkpoints"
        )
    if any(f.startswith("data-") for f in files):
        raise CheckpointNotFoundError(
            f"{backend.url} holds an unfinished save (data files but no {INDEX_NAME}), not a root of checkpoints"
        )
    raise CheckpointNotFoundError(f"{backend.url} holds no checkpoints (no step-NNNNNNNNNNNN directories)")
