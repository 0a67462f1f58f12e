"""Generic fsspec backend (``memory://``, ``gcs://``, ``abfs://``...).

Used for every fsspec protocol that has no dedicated backend. Publishing is a single
``pipe_file`` of the whole index, which object stores apply atomically; stores without a
conditional write cannot refuse a concurrent publisher, so ``overwrite=False`` is checked
with ``exists`` first (documented as best effort in docs/FORMAT.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from shardstore.backends.base import Backend, FileWriter, check_relpath
from shardstore.errors import CheckpointExistsError, StorageError, TruncatedFileError


class _FsspecFileWriter(FileWriter):
    def __init__(self, backend: FsspecBackend, path: str) -> None:
        self._backend = backend
        self._path = backend._abs(path)
        self._f: Any = backend.fs.open(self._path, "wb")

    def write(self, data: memoryview | bytes) -> None:
        self._f.write(data)

    def close(self) -> None:
        if self._f is not None:
            f, self._f = self._f, None
            f.close()

    def abort(self) -> None:
        if self._f is not None:
            f, self._f = self._f, None
            discard = getattr(f, "discard", None)
            if discard is not None:
                discard()
            else:
                f.close()
        try:
            self._backend.fs.rm_file(self._path)
        except FileNotFoundError:
            pass


class FsspecBackend(Backend):
    """Files below ``root`` on any fsspec file system."""

    def __init__(self, fs: Any, root: str, *, url: str) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        self.url = url.rstrip("/")

    def _abs(self, path: str) -> str:
        return f"{self.root}/{check_relpath(path)}"

    def child(self, name: str) -> FsspecBackend:
        rel = check_relpath(name)
        return FsspecBackend(self.fs, f"{self.root}/{rel}", url=f"{self.url}/{rel}")

    def open_writer(self, path: str) -> FileWriter:
        return _FsspecFileWriter(self, path)

    def read_ranges(self, path: str, ranges: Sequence[tuple[int, int]]) -> list[bytes | memoryview]:
        full = self._abs(path)
        out: list[bytes | memoryview] = []
        for start, length in ranges:
            data = self.fs.cat_file(full, start=start, end=start + length)
            if len(data) != length:
                raise TruncatedFileError(
                    f"{self.url}/{path} is truncated: wanted bytes [{start}, {start + length}), "
                    f"got {len(data)}"
                )
            out.append(data)
        return out

    def read_small(self, path: str) -> bytes:
        return self.fs.cat_file(self._abs(path))

    def publish(self, path: str, data: bytes, *, overwrite: bool) -> None:
        full = self._abs(path)
        if not overwrite and self.fs.exists(full):
            raise CheckpointExistsError(f"{self.url}/{path} already exists")
        try:
            self.fs.pipe_file(full, data)
        except OSError as e:
            raise StorageError(f"cannot publish {self.url}/{path}: {e}") from e

    def size(self, path: str) -> int:
        return int(self.fs.size(self._abs(path)))

    def exists(self, path: str) -> bool:
        return bool(self.fs.isfile(self._abs(path)))

    def list(self, prefix: str = "") -> list[str]:
        base = self._abs(prefix) if prefix else self.root
        try:
            found = self.fs.find(base)
        except FileNotFoundError:
            return []
        cut = len(self.root.lstrip("/")) + 1
        return sorted(p.lstrip("/")[cut:] for p in found)

    def delete(self, paths: Sequence[str]) -> None:
        for p in paths:
            try:
                self.fs.rm_file(self._abs(p))
            except FileNotFoundError:
                pass
