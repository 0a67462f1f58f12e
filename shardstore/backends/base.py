"""Storage backend interface: the bottom stage of both data flows.

Everything above this module (writer, reader, manager, CLI) talks to storage only through
:class:`Backend`, so it never knows whether it is on a local disk, NFS or S3. A backend works
with paths relative to its root (a checkpoint directory or a manager root); it never lets a path
leave that root.

The interface is deliberately small:

* :meth:`Backend.open_writer` streams one data file (each rank writes its own files);
* :meth:`Backend.read_ranges` reads byte ranges of one file, and :meth:`Backend.open_reader`
  opens one for a load's scatter reads straight into caller memory (frames land in the target
  tensors);
* :meth:`Backend.publish` atomically writes one small object (the index: the commit record);
* :meth:`Backend.read_small`, :meth:`Backend.size`, :meth:`Backend.list`, :meth:`Backend.delete`
  and :meth:`Backend.exists` for inspection and cleanup.
"""

from __future__ import annotations

import abc
import posixpath
from collections.abc import Sequence

from shardstore.errors import InvalidCheckpointError, TruncatedFileError


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


class FileReader(abc.ABC):
    """A data file open for the positional reads of one load; safe to share between threads."""

    @abc.abstractmethod
    def read_into(self, start: int, buffers: Sequence[memoryview]) -> None:
        """Read consecutive bytes from ``start`` into ``buffers``, in order (a scatter read).

        The first ``buffers[0].nbytes`` bytes go to ``buffers[0]``, the next ones to
        ``buffers[1]``, and so on. Buffers are writable, C-contiguous byte views (format ``B``).

        Raises:
            TruncatedFileError: the file ends before the last buffer is full.
        """

    def close(self) -> None:
        """Release the file."""

    def __enter__(self) -> FileReader:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()


class RangeFileReader(FileReader):
    """Scatter reads for stores that can only hand out new byte objects (fsspec, S3).

    Each :meth:`read_into` reads its whole range with :meth:`Backend.read_ranges` and copies it
    into the buffers: one more pass over the bytes than a backend that reads into the buffers
    itself (POSIX: ``preadv``), which is the price of the store's interface, not a fallback.
    """

    def __init__(self, backend: Backend, path: str) -> None:
        self.backend = backend
        self.path = path

    def read_into(self, start: int, buffers: Sequence[memoryview]) -> None:
        total = sum(b.nbytes for b in buffers)
        if not total:
            return
        (data,) = self.backend.read_ranges(self.path, [(start, total)])
        view = memoryview(data).cast("B")
        if view.nbytes != total:
            raise TruncatedFileError(
                f"{self.backend.url}/{self.path} is truncated: wanted bytes [{start}, {start + total}), "
                f"got {view.nbytes}"
            )
        pos = 0
        for b in buffers:
            b[:] = view[pos : pos + b.nbytes]
            pos += b.nbytes


class Backend(abc.ABC):
    """Byte storage rooted at one directory / prefix. Paths are ``/``-separated and relative."""

    #: URL or path of the root, for error messages.
    url: str

    #: Bytes one read call should fetch for this store to be efficient, or ``None`` for no
    #: preference. A load cuts its runs of frames at ``max(ReadOptions.max_range, read_size)``:
    #: an object store wants few large, internally parallel requests (S3: ``part_size`` x
    #: ``max_concurrency``), a local disk small runs that stay in the CPU cache.
    read_size: int | None = None

    @abc.abstractmethod
    def open_writer(self, path: str) -> FileWriter:
        """Start writing ``path`` (replacing any file of that name once closed)."""

    @abc.abstractmethod
    def read_ranges(self, path: str, ranges: Sequence[tuple[int, int]]) -> list[bytes | memoryview]:
        """Read ``(start, length)`` ranges of ``path``; a short read raises ``TruncatedFileError``."""

    def open_reader(self, path: str) -> FileReader:
        """Open ``path`` for the positional reads of one load (shared by its threads).

        The default reads through :meth:`read_ranges` (see :class:`RangeFileReader`); backends
        that can read into caller memory override it (POSIX).

        Raises:
            FileNotFoundError: ``path`` does not exist (where the store can tell at open).
        """
        return RangeFileReader(self, path)

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
