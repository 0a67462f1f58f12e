"""Storage backend interface: the bottom stage of both data flows.

Everything above this module (writer, reader, manager, CLI) talks to storage only through
:class:`Backend`, so it never knows whether it is on a local disk, NFS or S3. A backend works
with paths relative to its root (a checkpoint directory or a manager root); it never lets a path
leave that root.

The interface is deliberately small:

* :meth:`Backend.open_writer` streams one data file (each rank writes its own files);
* :meth:`Backend.read_ranges` reads byte ranges of one file;
* :meth:`Backend.publish` atomically writes one small object (the index: the commit record);
* :meth:`Backend.read_small`, :meth:`Backend.size`, :meth:`Backend.list`, :meth:`Backend.delete`
  and :meth:`Backend.exists` for inspection and cleanup.
"""

from __future__ import annotations

import abc
import posixpath
from collections.abc import Sequence

from shardstore.errors import InvalidCheckpointError


def check_relpath(path: str) -> str:
    """Return ``path`` normalised, or raise if it could leave the backend's root.

    Index entries name files by relative path. A path that is absolute, contains ``..`` or a
    backslash, or is empty is rejected, so a crafted index can never make a reader touch files
    outside the checkpoint.
    """
    if not isinstance(path, str) or not path:
        raise InvalidCheckpointError(f"invalid file path in checkpoint: {path!r}")
    if path.startswith("/") or "\\" in path or "\x00" in path:
        raise InvalidCheckpointError(f"file path leaves the checkpoint: {path!r}")
    parts = path.split("/")
    if any(p in ("", ".", "..") for p in parts) or ":" in parts[0]:
        raise InvalidCheckpointError(f"file path leaves the checkpoint: {path!r}")
    return posixpath.normpath(path)


class FileWriter(abc.ABC):
    """A data file being written sequentially; visible to readers only after :meth:`close`.

    ``abort`` discards everything written (on S3 it aborts the multipart upload), so a failed
    save leaves nothing behind that could be mistaken for data.
    """

    @abc.abstractmethod
    def write(self, data: memoryview | bytes) -> None:
        """Append ``data`` to the file."""

    @abc.abstractmethod
    def close(self) -> None:
        """Make the file durable (fsync / complete the upload)."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Discard the partial file; never raises for an already-gone file."""

    def __enter__(self) -> FileWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class Backend(abc.ABC):
    """Byte storage rooted at one directory / prefix. Paths are ``/``-separated and relative."""

    #: URL or path of the root, for error messages.
    url: str

    @abc.abstractmethod
    def open_writer(self, path: str) -> FileWriter:
        """Start writing ``path`` (replacing any file of that name once closed)."""

    @abc.abstractmethod
    def read_ranges(self, path: str, ranges: Sequence[tuple[int, int]]) -> list[bytes | memoryview]:
        """Read ``(start, length)`` ranges of ``path``; a short read raises ``TruncatedFileError``."""

    @abc.abstractmethod
    def read_small(self, path: str) -> bytes:
        """Read a whole small object (the index). Missing -> ``FileNotFoundError``."""

    @abc.abstractmethod
    def publish(self, path: str, data: bytes, *, overwrite: bool) -> None:
        """Atomically make ``data`` visible at ``path``: readers see all of it or nothing.

        With ``overwrite=False`` an existing object is never replaced
        (``CheckpointExistsError``), also against a concurrent publisher where the store
        supports it.
        """

    @abc.abstractmethod
    def size(self, path: str) -> int:
        """Size of ``path`` in bytes. Missing -> ``FileNotFoundError``."""

    @abc.abstractmethod
    def exists(self, path: str) -> bool:
        """Whether ``path`` exists (as a file)."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """All file paths below ``prefix`` (recursive), relative to the root, sorted."""

    @abc.abstractmethod
    def delete(self, paths: Sequence[str]) -> None:
        """Delete files; missing ones are ignored."""

    def child(self, name: str) -> Backend:
        """A backend rooted at the sub-directory ``name`` (used by the manager for steps)."""
        raise NotImplementedError(type(self).__name__ + ".child")

    def close(self) -> None:
        """Release connections and threads."""
