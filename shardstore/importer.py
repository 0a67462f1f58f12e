"""Import: safetensors files as a DCP checkpoint, for sharded loads and for conversion.

The load flow with a foreign format underneath. :class:`SafetensorsReader` is a DCP
``StorageReader`` over one safetensors file or a directory of them (a Hugging Face model's
``model-0000k-of-0000n.safetensors``): its metadata describes every tensor as one stored chunk,
so DCP's load planner computes, on each rank, the sub-box of each tensor that rank's shard needs
(FSDP2, DTensor, TP: any layout), and :meth:`SafetensorsReader.read_data` turns each sub-box into
the byte ranges that hold it — one range for a row shard, one per row for a column shard, merged
when the gaps are small — so a rank reads about its share of the file, never a full copy::

    model = fully_shard(build_model())
    sd = model.state_dict()
    dcp.load(sd, storage_reader=SafetensorsReader("/models/llama"))   # or load_safetensors(sd, ...)

:func:`import_safetensors` writes a safetensors file as a shardstore checkpoint from one process,
reading each tensor only when the writer asks for it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import posixpath
import struct
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem, WriteItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from shardstore.backends import Backend, open_backend
from shardstore.config import MiB, ReadOptions
from shardstore.errors import CheckpointNotFoundError, InvalidCheckpointError, StateMismatchError, TruncatedFileError
from shardstore.export import MAX_HEADER, SafetensorsEntry, decode_safetensors_header
from shardstore.progress import Progress, silent
from shardstore.writer import ShardWriter

logger = logging.getLogger(__name__)

#: Byte runs of one read item closer than this are fetched as one range (fewer requests).
MERGE_GAP = 4096
SUFFIX = ".safetensors"
INDEX_SUFFIX = ".safetensors.index.json"


@dataclass(frozen=True)
class _Source:
    """Where one tensor lives: file, absolute byte offset of its data, and its entry."""

    file: str
    data_start: int
    entry: SafetensorsEntry


def _read_header(backend: Backend, name: str) -> tuple[int, dict[str, SafetensorsEntry]]:
    where = f"{backend.url}/{name}"
    try:
        size = backend.size(name)
        if size < 8:
            raise InvalidCheckpointError(f"{where} is not a safetensors file ({size} bytes)")
        (n,) = struct.unpack("<Q", bytes(backend.read_ranges(name, [(0, 8)])[0]))
        if n > MAX_HEADER or 8 + n > size:
            raise InvalidCheckpointError(f"{where} is not a safetensors file (header length {n} for a {size}-byte file)")
        header = bytes(backend.read_ranges(name, [(8, n)])[0])
    except TruncatedFileError as e:
        raise InvalidCheckpointError(f"{where} is not a safetensors file: {e}") from None
    entries, _ = decode_safetensors_header(header, source=where)
    data_start = 8 + n
    for e in entries.values():
        if data_start + e.end > size:
            raise InvalidCheckpointError(f"{where} is truncated: tensor {e.name!r} ends past the end of the file")
    return data_start, entries


def _open_files(path: str, storage_options: dict[str, Any] | None) -> tuple[Backend, list[str]]:
    """The backend and safetensors file names for a file or a directory of them."""
    local = "://" not in path or path.startswith("file://")
    plain = path.removeprefix("file://") if local else path
    if local and not os.path.exists(plain):
        raise CheckpointNotFoundError(f"no safetensors file or directory at {plain}")
    if path.endswith(SUFFIX) and (not local or os.path.isfile(plain)):
        parent, name = (os.path.split(os.path.abspath(plain)) if local else posixpath.split(path.rstrip("/")))
        return open_backend(parent, storage_options), [name]
    backend = open_backend(path, storage_options)
    if local and os.path.isfile(plain):
        raise InvalidCheckpointError(f"{plain} is not a safetensors file (its name does not end in {SUFFIX})")
    listing = [p for p in backend.list() if "/" not in p]
    names = [p for p in listing if p.endswith(SUFFIX)]
    if not names:
        raise CheckpointNotFoundError(f"no {SUFFIX} files in {backend.url}")
    indexes = [p for p in listing if p.endswith(INDEX_SUFFIX)]
    if len(indexes) == 1:  # a Hugging Face sharded model: its index says which files hold the weights
        try:
            weight_map = json.loads(backend.read_small(indexes[0]))["weight_map"]
            wanted = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise InvalidCheckpointError(f"{backend.url}/{indexes[0]} is not a safetensors index: {e!r}") from None
        missing = [n for n in wanted if n not in names]
        if missing:
            raise CheckpointNotFoundError(f"{backend.url}/{indexes[0]} names files that are not there: {missing}")
        names = wanted
    return backend, names


class SafetensorsReader(StorageReader):
    """DCP ``StorageReader`` over a safetensors file, or a directory (URL prefix) of them.

    Args:
        path: a ``.safetensors`` file, or a directory holding ``*.safetensors`` files (their
            tensors are merged; a name in two files is an error; with one
            ``*.safetensors.index.json`` only the files its ``weight_map`` names). Local path
            or URL.
        storage_options: passed to fsspec.
        add_prefix: prepended to every tensor name in the files, to match the state dict's
            names (e.g. ``"model."``).
        threads: parallel read threads (0: the default).
        max_range: the most bytes fetched in one merged range.

    Raises:
        CheckpointNotFoundError: nothing at ``path``.
        InvalidCheckpointError: a file is not valid safetensors.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        storage_options: dict[str, Any] | None = None,
        add_prefix: str = "",
        threads: int = 0,
        max_range: int = 64 * MiB,
    ) -> None:
        super().__init__()
        self.options = ReadOptions(threads=threads, max_range=max_range)
        self.path = os.fspath(path)
        self.backend, names = _open_files(self.path, storage_options)
        self.sources: dict[str, _Source] = {}
        for name in sorted(names):
            data_start, entries = _read_header(self.backend, name)
            for e in entries.values():
                fqn = add_prefix + e.name
                if fqn in self.sources:
                    raise InvalidCheckpointError(
                        f"tensor {e.name!r} is in both {self.sources[fqn].file} and {name} in {self.backend.url}"
                    )
                self.sources[fqn] = _Source(name, data_start, e)
        self.bytes_read = 0
        self._lock = threading.Lock()

    # -- DCP protocol ---------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self.bytes_read = 0

    def read_metadata(self) -> Metadata:
        md: dict[str, Any] = {}
        for fqn, s in self.sources.items():
            shape = torch.Size(s.entry.shape)
            md[fqn] = TensorStorageMetadata(
                properties=TensorProperties(dtype=s.entry.dtype),
                size=shape,
                chunks=[ChunkStorageMetadata(offsets=torch.Size([0] * len(shape)), sizes=shape)],
            )
        return Metadata(state_dict_metadata=md)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

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
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                raise StateMismatchError(
                    f"{item.storage_index.fqn!r} is not a tensor; a safetensors file holds tensors only"
                )
        planner_lock = threading.Lock()
        with ThreadPoolExecutor(self.options.threads, "shardstore-import") as pool:
            futures = [pool.submit(self._read_item, item, planner, planner_lock) for item in plan.items]
            errors = []
            for f in futures:
                try:
                    f.result()
                except Exception as e:  # let every item finish, then raise the first failure
                    errors.append(e)
        if errors:
            raise errors[0]
        seconds = time.perf_counter() - t0
        logger.info(
            "loaded %s: %d items, %.1f MB read, %.2f s", self.backend.url, len(plan.items), self.bytes_read / 1e6, seconds
        )
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    # -- one read item ----------------------------------------------------------------------

    def _runs(self, src: _Source, item: ReadItem) -> tuple[np.ndarray, int]:
        """Byte offsets (in the file) of the contiguous runs holding the item's box, and run length."""
        shape, itemsize = src.entry.shape, src.entry.dtype.itemsize
        offsets, lengths = list(item.storage_offsets), list(item.lengths)
        strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
        k = len(shape) - 1
        while k >= 0 and offsets[k] == 0 and lengths[k] == shape[k]:
            k -= 1
        if k < 0:  # the whole tensor (or a scalar)
            return np.array([src.data_start + src.entry.begin], dtype=np.int64), math.prod(shape) * itemsize
        starts = np.array(offsets[k] * strides[k], dtype=np.int64)
        for d in range(k):
            axis = (np.arange(lengths[d], dtype=np.int64) + offsets[d]) * strides[d]
            starts = np.add.outer(starts, axis) if starts.ndim else axis + starts
        return src.data_start + src.entry.begin + starts.reshape(-1) * itemsize, lengths[k] * strides[k] * itemsize

    def _ranges(self, starts: np.ndarray, run: int) -> list[tuple[int, int, int, int]]:
        """Merge runs into ``(start, length, first run, end run)`` ranges."""
        out = []
        i = 0
        n = len(starts)
        while i < n:
            j = i + 1
            while (
                j < n
                and starts[j] - (starts[j - 1] + run) <= MERGE_GAP
                and starts[j] + run - starts[i] <= self.options.max_range
            ):
                j += 1
            out.append((int(starts[i]), int(starts[j - 1] + run - starts[i]), i, j))
            i = j
        return out

    def _read_item(self, item: ReadItem, planner: LoadPlanner, planner_lock: threading.Lock) -> None:
        fqn = item.storage_index.fqn
        src = self.sources.get(fqn)
        if src is None:
            raise StateMismatchError(f"tensor {fqn!r} is not in {self.backend.url}")
        if math.prod(item.lengths) == 0:
            with planner_lock:
                planner.commit_tensor(item, planner.resolve_tensor(item))
            return
        starts, run = self._runs(src, item)
        ranges = self._ranges(starts, run)
        try:
            bufs = self.backend.read_ranges(src.file, [(a, n) for a, n, _, _ in ranges])
        except TruncatedFileError as e:
            raise TruncatedFileError(f"{self.backend.url}/{src.file} is truncated (reading {fqn!r}): {e}") from None
        with self._lock:
            self.bytes_read += sum(n for _, n, _, _ in ranges)
        if len(ranges) == 1 and ranges[0][3] - ranges[0][2] == 1:
            data = memoryview(bufs[0])
        else:
            joined = np.empty(len(starts) * run, dtype=np.uint8)
            for (a, _n, r0, r1), buf in zip(ranges, bufs):
                view = np.frombuffer(buf, dtype=np.uint8)
                for r in range(r0, r1):
                    lo = int(starts[r]) - a
                    joined[r * run : (r + 1) * run] = view[lo : lo + run]
            data = memoryview(joined)
        source = torch.frombuffer(data, dtype=src.entry.dtype).view(tuple(item.lengths))
        with planner_lock:
            target = planner.resolve_tensor(item).detach()
        if tuple(target.shape) != tuple(item.lengths):
            raise StateMismatchError(f"{fqn!r}: target has shape {tuple(target.shape)}, read item has {tuple(item.lengths)}")
        target.copy_(source)
        with planner_lock:
            planner.commit_tensor(item, target)


def load_safetensors(
    state_dict: dict[str, Any],
    path: str | os.PathLike,
    *,
    storage_options: dict[str, Any] | None = None,
    add_prefix: str = "",
    process_group: Any = None,
    planner: LoadPlanner | None = None,
) -> SafetensorsReader:
    """Load safetensors weights into ``state_dict`` in place (plain, DTensor or FSDP2 state).

    Every rank calls it with its own (sharded) state dict; each reads only its shards' bytes.

    Returns:
        The reader (its ``bytes_read`` says how much this rank read).
    """
    reader = SafetensorsReader(path, storage_options=storage_options, add_prefix=add_prefix)
    dcp.load(state_dict, storage_reader=reader, process_group=process_group, planner=planner)
    return reader


# ---------------------------------------------------------------------------------------------
# Conversion to a shardstore checkpoint (shardstore import)


class _LazySavePlanner(DefaultSavePlanner):
    """Plans from meta tensors; reads each tensor from the source only when the writer asks."""

    def __init__(self, reader: SafetensorsReader, progress: Progress) -> None:
        super().__init__()
        self._source = reader
        self._progress = progress

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        fqn = write_item.index.fqn
        src = self._source.sources[fqn]
        out = torch.empty(src.entry.shape, dtype=src.entry.dtype)
        item = ReadItem(
            type=LoadItemType.TENSOR,
            dest_index=write_item.index,
            dest_offsets=torch.Size([0] * len(src.entry.shape)),
            storage_index=write_item.index,
            storage_offsets=torch.Size([0] * len(src.entry.shape)),
            lengths=torch.Size(src.entry.shape),
        )
        self._source._read_item(item, _Into(out), threading.Lock())
        self._progress.update(out.numel() * out.element_size())
        return out


class _Into(LoadPlanner):
    """A ``LoadPlanner`` stand-in that hands :meth:`SafetensorsReader._read_item` one tensor."""

    def __init__(self, target: torch.Tensor) -> None:
        self.target = target

    def set_up_planner(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("_Into only serves one read")

    def create_local_plan(self) -> LoadPlan:
        raise NotImplementedError("_Into only serves one read")

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        raise NotImplementedError("_Into only serves one read")

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        raise NotImplementedError("_Into only serves one read")

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        raise NotImplementedError("_Into only serves one read")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        return self.target

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass


@dataclass
class ImportResult:
    """What :func:`import_safetensors` wrote."""

    out: str
    tensors: int
    bytes: int
    seconds: float


def import_safetensors(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    add_prefix: str = "",
    storage_options: dict[str, Any] | None = None,
    progress: Progress | None = None,
    **writer_options: Any,
) -> ImportResult:
    """Write the safetensors file (or directory) ``src`` as a shardstore checkpoint at ``dst``.

    Runs in one process (no process group). Each writer thread holds one tensor at a time.

    Args:
        src: ``.safetensors`` file or directory of them.
        dst: checkpoint directory or URL to create.
        add_prefix: prepended to every tensor name.
        storage_options: fsspec options for ``src`` and ``dst``.
        progress: a byte counter to advance.
        **writer_options: :class:`~shardstore.ShardWriter` options (``compression``,
            ``threads``, ``overwrite``...).
    """
    t0 = time.perf_counter()
    progress = progress or silent()
    reader = SafetensorsReader(src, storage_options=storage_options, add_prefix=add_prefix)
    plan_sd = {
        fqn: torch.empty(s.entry.shape, dtype=s.entry.dtype, device="meta") for fqn, s in reader.sources.items()
    }
    total = sum(s.entry.end - s.entry.begin for s in reader.sources.values())
    progress.set_total(total)
    writer = ShardWriter(dst, storage_options=storage_options, **writer_options)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.save(plan_sd, storage_writer=writer, planner=_LazySavePlanner(reader, progress), no_dist=True)
    seconds = time.perf_counter() - t0
    logger.info("imported %s into %s: %d tensors, %.1f MB, %.2f s", src, dst, len(plan_sd), total / 1e6, seconds)
    return ImportResult(out=writer.backend.url, tensors=len(plan_sd), bytes=total, seconds=round(seconds, 3))
