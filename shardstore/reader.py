"""ShardReader: DCP ``StorageReader`` that reads only the frames a load needs, verified.

DCP calls a storage reader in this order (``torch.distributed.checkpoint.load``)::

    reset(checkpoint_id)                          all ranks, when a checkpoint_id is given
    read_metadata()                               all ranks: the index, as DCP Metadata
    set_up_storage_reader(metadata, is_coord)     all ranks
    prepare_local_plan(plan)                      all ranks
    prepare_global_plan(plans)                    coordinator
    read_data(plan, planner)                      all ranks

Resharding is DCP's: its load planner turns the index's chunk list into ``ReadItem``s (which
stored chunk, which sub-box of it, where it lands). ``read_data`` maps each sub-box to the byte
span of the chunk that holds it, to the frames covering that span, and to a byte range of a data
file; ranges of one file are sorted and merged, read by several threads, verified frame by
frame, decoded, and copied into the target tensors (with a dtype cast where the target differs).

The index is read and validated when the reader is constructed, so a missing or malformed
checkpoint fails at ``ShardReader(path)`` with a clear error rather than inside DCP.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future
from torch.distributed.checkpoint.storage import StorageReader

from shardstore.backends import Backend, open_backend, sibling_url
from shardstore.codec import Codec, decode_frame, frame_hash
from shardstore.config import INDEX_NAME, ReadOptions
from shardstore.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    StateMismatchError,
    TruncatedFileError,
)
from shardstore.index import FileEntry, Index, TensorEntry, decode_index
from shardstore.values import value_to_dcp_bytes

logger = logging.getLogger(__name__)

# Source buffers are only ever read from (copied into targets), never written.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)

#: Ranges of one file closer than this are merged (records are padded to 64-byte boundaries).
MERGE_GAP = 64


def load_index(backend: Backend) -> Index:
    """Read and validate the index of the checkpoint at ``backend``'s root.

    Raises:
        CheckpointNotFoundError: no committed checkpoint there; the message says what is there.
        InvalidCheckpointError: the index is malformed.
    """
    try:
        data = backend.read_small(INDEX_NAME)
    except (FileNotFoundError, NotADirectoryError):
        try:
            files = backend.list()
        except (FileNotFoundError, NotADirectoryError):
            files = []
        if not files:
            raise CheckpointNotFoundError(f"no checkpoint at {backend.url}: the path does not exist or is empty") from None
        if ".metadata" in files:
            raise CheckpointNotFoundError(
                f"{backend.url} is a checkpoint of DCP's own FileSystemWriter, not a shardstore checkpoint"
            ) from None
        if any(f.startswith("data-") for f in files):
            raise CheckpointNotFoundError(
                f"{backend.url} holds an unfinished save (data files but no {INDEX_NAME}); it was never committed"
            ) from None
        raise CheckpointNotFoundError(f"{backend.url} is not a shardstore checkpoint (no {INDEX_NAME})") from None
    return decode_index(data, source=f"{backend.url}/{INDEX_NAME}")


@dataclass
class _Need:
    """One ReadItem mapped to stored bytes: frames ``g0:g1`` of tensor ``fqn``."""

    item: ReadItem
    fqn: str
    tensor: TensorEntry
    chunk: int
    span: tuple[int, int]  # byte span [a, b) inside the chunk's raw bytes
    g0: int  # first frame (tensor-global frame id)
    g1: int
    start: int  # byte range [start, end) in the data file
    end: int


class ShardReader(StorageReader):
    """Read a checkpoint written by :class:`~shardstore.ShardWriter`, on any number of ranks.

    Args:
        path: checkpoint directory or URL.
        storage_options: passed to fsspec.
        **options: fields of :class:`shardstore.config.ReadOptions` (``threads``,
            ``max_range``, ``verify``).

    Raises:
        CheckpointNotFoundError: ``path`` holds no committed checkpoint.
        InvalidCheckpointError: the index is malformed or of an unknown version.
    """

    def __init__(
        self, path: str | os.PathLike | Backend, *, storage_options: dict[str, Any] | None = None, **options: Any
    ) -> None:
        super().__init__()
        self.options = ReadOptions(**options)
        self.storage_options = storage_options
        self.bytes_read = 0
        self._open(path)

    def _open(self, path: str | os.PathLike | Backend) -> None:
        self.backend = open_backend(path, self.storage_options)
        self.path = self.backend.url if isinstance(path, Backend) else os.fspath(path)
        self.index = load_index(self.backend)
        self._metadata: Metadata | None = None
        self._siblings: dict[str, Backend] = {}

    # -- DCP protocol ---------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None and os.fspath(checkpoint_id) != self.path:
            self._open(os.fspath(checkpoint_id))
        self.bytes_read = 0

    def read_metadata(self) -> Metadata:
        if self._metadata is None:
            self._metadata = self.index.to_metadata()
        return self._metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        t0 = time.perf_counter()
        self.bytes_read = 0
        needs: dict[int, list[_Need]] = {}
        for item in plan.items:
            fqn = item.storage_index.fqn
            if item.type == LoadItemType.BYTE_IO:
                if fqn not in self.index.values:
                    raise StateMismatchError(f"{fqn!r} is not a stored value in {self.backend.url}")
                planner.load_bytes(item, value_to_dcp_bytes(self.index.values[fqn]))
                continue
            need = self._map(item)
            if need is None:  # nothing to read (an empty tensor)
                planner.commit_tensor(item, planner.resolve_tensor(item))
                continue
            needs.setdefault(int(need.tensor.file[need.chunk]), []).append(need)

        lock = threading.Lock()
        tasks = []
        for file_id, file_needs in needs.items():
            for group in self._merge(file_needs):
                tasks.append((file_id, group))
        with ThreadPoolExecutor(self.options.threads, "shardstore-read") as pool:
            futures = [pool.submit(self._read_range, fid, group, planner, lock) for fid, group in tasks]
            errors = []
            for f in futures:
                try:
                    f.result()
                except Exception as e:  # let every range finish, then raise the first failure
                    errors.append(e)
        if errors:
            raise errors[0]
        seconds = time.perf_counter() - t0
        logger.info(
            "loaded %s: %d items, %.1f MB read, %.2f s, %.2f GB/s",
            self.backend.url, len(plan.items), self.bytes_read / 1e6, seconds, self.bytes_read / max(seconds, 1e-9) / 1e9,
        )
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    # -- planning the reads ---------------------------------------------------------------

    def _map(self, item: ReadItem) -> _Need | None:
        fqn = item.storage_index.fqn
        t = self.index.tensors.get(fqn)
        if t is None:
            raise StateMismatchError(f"tensor {fqn!r} is not in checkpoint {self.backend.url}")
        c = t.chunk_id(item.storage_index.offset or (), item.storage_index.index)
        sizes = t.sizes[c].tolist()
        lengths = list(item.lengths)
        if 0 in lengths or 0 in sizes:
            return None
        strides = _row_major_strides(sizes)
        first = sum(o * s for o, s in zip(item.storage_offsets, strides))
        last = sum((o + n - 1) * s for o, n, s in zip(item.storage_offsets, lengths, strides))
        itemsize = t.itemsize
        a, b = first * itemsize, (last + 1) * itemsize
        fs = self.index.frame_size
        base = int(t.frame_start[c])
        g0, g1 = base + a // fs, base + (b - 1) // fs + 1
        fp = t.frame_pos
        return _Need(item, fqn, t, c, (a, b), g0, g1, int(fp[g0]), int(fp[g1 - 1] + t.frame_len[g1 - 1]))

    def _merge(self, needs: list[_Need]) -> list[list[_Need]]:
        """Sort by file position; group needs whose byte ranges touch, up to ``max_range``."""
        needs.sort(key=lambda n: n.start)
        groups: list[list[_Need]] = []
        start = end = -1
        for n in needs:
            if groups and n.start <= end + MERGE_GAP and (max(end, n.end) - start) <= self.options.max_range:
                groups[-1].append(n)
                end = max(end, n.end)
            else:
                groups.append([n])
                start, end = n.start, n.end
        return groups

    # -- reading one merged range ---------------------------------------------------------

    def open_file(self, entry: FileEntry) -> tuple[Backend, str]:
        """The backend and path holding a data file, following incremental references."""
        if entry.base is None:
            return self.backend, entry.path
        backend = self._siblings.get(entry.base)
        if backend is None:
            backend = self._siblings[entry.base] = open_backend(sibling_url(self.path, entry.base), self.storage_options)
        return backend, entry.path

    def _read_range(self, file_id: int, group: list[_Need], planner: LoadPlanner, lock: threading.Lock) -> None:
        entry = self.index.files[file_id]
        backend, path = self.open_file(entry)
        shown = path if entry.base is None else f"../{entry.base}/{path}"  # for messages
        start = group[0].start
        end = max(n.end for n in group)
        try:
            (buf,) = backend.read_ranges(path, [(start, end - start)])
        except FileNotFoundError:
            raise CorruptCheckpointError(
                f"data file {shown} of checkpoint {self.backend.url} is missing (needed for {group[0].fqn!r})"
            ) from None
        except TruncatedFileError as e:
            raise TruncatedFileError(
                f"data file {shown} of checkpoint {self.backend.url} is truncated (needed for {group[0].fqn!r}): {e}"
            ) from None
        buf = memoryview(buf)
        with lock:
            self.bytes_read += buf.nbytes
        decoded: dict[tuple[str, int], memoryview | bytes] = {}
        for need in group:
            src = self._source(need, buf, start, shown, decoded)
            with lock:
                target = planner.resolve_tensor(need.item).detach()
            if tuple(target.shape) != tuple(need.item.lengths):
                raise StateMismatchError(
                    f"{need.fqn!r}: target has shape {tuple(target.shape)}, read item has {tuple(need.item.lengths)}"
                )
            target.copy_(src)
            with lock:
                planner.commit_tensor(need.item, target)

    def _source(
        self, need: _Need, buf: memoryview, start: int, path: str, decoded: dict[tuple[str, int], memoryview | bytes]
    ) -> torch.Tensor:
        """A tensor view of the read item's sub-box, from verified, decoded frames."""
        t, fs = need.tensor, self.index.frame_size
        fp = t.frame_pos
        record_raw = t.raw_nbytes(need.chunk)
        base = int(t.frame_start[need.chunk])
        pieces = []
        for g in range(need.g0, need.g1):
            raw = decoded.get((need.fqn, g))
            if raw is None:
                lo = int(fp[g]) - start
                stored = buf[lo : lo + int(t.frame_len[g])]
                k = g - base
                raw_len = min(fs, record_raw - k * fs)
                byte_range = f"bytes [{int(fp[g])}, {int(fp[g]) + int(t.frame_len[g])})"
                try:
                    raw = decode_frame(stored, int(t.frame_codec[g]), raw_len)
                except CorruptCheckpointError as e:
                    raise CorruptCheckpointError(
                        f"checkpoint {self.backend.url}, file {path}, tensor {need.fqn!r}, {byte_range}: {e} "
                        "(checksum cannot be verified)"
                    ) from None
                if self.options.verify and frame_hash(raw) != t.frame_hash[g].tobytes():
                    raise CorruptCheckpointError(
                        f"checksum mismatch in checkpoint {self.backend.url}, file {path}, tensor {need.fqn!r}, {byte_range}"
                    )
                decoded[(need.fqn, g)] = raw
            pieces.append(raw)
        a, b = need.span
        skip = a - (need.g0 - base) * fs
        all_raw = all(t.frame_codec[g] == Codec.RAW for g in range(need.g0, need.g1))
        if len(pieces) == 1 or all_raw:
            # Raw frames lie back to back in the file: view the span in place, no copy.
            lo = int(fp[need.g0]) - start + skip if all_raw else 0
            span = buf[lo : lo + (b - a)] if all_raw else memoryview(pieces[0])[skip : skip + (b - a)]
        else:
            joined = bytearray(b - a)
            pos = 0
            for i, p in enumerate(pieces):
                p = memoryview(p)[skip if i == 0 else 0 :]
                take = min(p.nbytes, len(joined) - pos)
                joined[pos : pos + take] = p[:take]
                pos += take
            span = memoryview(joined)
        flat = torch.frombuffer(span, dtype=t.dtype)
        sizes = t.sizes[need.chunk].tolist()
        strides = _row_major_strides(sizes)
        first = sum(o * s for o, s in zip(need.item.storage_offsets, strides))
        return flat.as_strided(list(need.item.lengths), strides, first - a // t.itemsize)


def _row_major_strides(sizes: list[int]) -> list[int]:
    strides = [1] * len(sizes)
    for d in range(len(sizes) - 2, -1, -1):
        strides[d] = strides[d + 1] * sizes[d + 1]
    return strides
