"""Choose a storage backend for a path or URL.

Local paths and ``file://`` URLs get the POSIX backend (pwrite/fsync/rename); ``s3://`` gets the
S3 backend; every other fsspec protocol (``memory://``, ``gcs://``...) the generic fsspec one.
URLs are resolved with ``fsspec.core.url_to_fs``, never parsed by hand.
"""

from __future__ import annotations

import os
from typing import Any

from shardstore.backends.base import Backend, FileWriter, check_relpath

__all__ = ["Backend", "FileWriter", "check_relpath", "open_backend", "sibling_url"]


def sibling_url(path: str | os.PathLike, name: str) -> str:
    """The path or URL of ``name`` next to ``path`` (same parent directory or prefix).

    Incremental checkpoints reference files of a sibling checkpoint by its name; this is the
    one place that turns such a name into a location.
    """
    check_relpath(name)
    if "/" in name:
        raise ValueError(f"a sibling checkpoint's name has no '/': {name!r}")
    url = os.fspath(path).rstrip("/")
    if "://" in url and not url.startswith("file://"):
        return f"{url.rpartition('/')[0]}/{name}"
    local = url[len("file://"):] if url.startswith("file://") else url
    return os.path.join(os.path.dirname(os.path.abspath(local)), name)


def open_backend(path: str | os.PathLike | Backend, storage_options: dict[str, Any] | None = None) -> Backend:
    """Return the backend for ``path`` (a plain path or an fsspec URL).

    A :class:`Backend` instance is returned as it is: that is how a caller passes options that
    belong to one backend (e.g. ``S3Backend(url, part_size=..., max_concurrency=...)``).
    """
    if isinstance(path, Backend):
        return path
    url = os.fspath(path)
    if "://" not in url or url.startswith("file://"):
        from shardstore.backends.posix import PosixBackend

        local = url[len("file://"):] if url.startswith("file://") else url
        return PosixBackend(local)
    import fsspec.core

    fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    if "s3" in protocols or "s3a" in protocols:
        from shardstore.backends.s3 import S3Backend

        return S3Backend(url, storage_options=storage_options)
    from shardstore.backends.fsspec import FsspecBackend

    return FsspecBackend(fs, root, url=url)
