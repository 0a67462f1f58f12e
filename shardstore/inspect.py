"""Looking inside a checkpoint from one process: summaries, bounded regions of tensors, diffs.

This is the load flow run by a tool instead of a training job: no process group, no model, and
memory bounded by a read *window* rather than by the model or its largest tensor. A tensor is
cut into :class:`Box` es — sub-boxes that are contiguous in row-major order and at most a window
in size — and boxes are read in batches through :meth:`ShardReader.read_data`, with the
``ReadItem`` s computed by DCP's own ``create_read_items_for_chunk_list`` (the same overlap math
its load planner uses for resharding). Fetching, merging ranges, verifying checksums and
decoding frames therefore stay the reader's; this module only decides which box to read next.
Export (:mod:`shardstore.export`) and ``shardstore diff`` are built on it.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from shardstore.config import MiB
from shardstore.index import Index, TensorEntry
from shardstore.progress import Progress, silent
from shardstore.reader import ShardReader
from shardstore.values import unpack_value

#: Default read window: the raw bytes of tensor data one batch of reads may hold.
DEFAULT_WINDOW = 16 * MiB


@dataclass(frozen=True)
class Box:
    """A sub-box of tensor ``fqn`` that is one contiguous run of its row-major bytes.

    Attributes:
        fqn: the tensor's flattened DCP name.
        offsets: where the box starts, per dimension.
        sizes: its extent, per dimension.
        start: its first element's index in the flattened tensor.
    """

    fqn: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    start: int

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def iter_boxes(fqn: str, shape: tuple[int, ...], itemsize: int, window: int) -> Iterator[Box]:
    """Cover a tensor with boxes of at most ``window`` bytes, in row-major order.

    Each box fixes the indices of the leading dimensions, takes a range of one dimension and
    all of the trailing ones, so its elements are contiguous in the flattened tensor and the
    boxes, in order, tile it from first to last element. An empty tensor has no boxes.
    """
    if 0 in shape:
        return
    ndim = len(shape)
    if ndim == 0:
        yield Box(fqn, (), (), 0)
        return
    max_elems = max(1, window // itemsize)
    suffix = [1] * (ndim + 1)  # suffix[d] = prod(shape[d:])
    for d in range(ndim - 1, -1, -1):
        suffix[d] = suffix[d + 1] * shape[d]
    d = next(d for d in range(ndim) if suffix[d + 1] <= max_elems)
    step = max(1, max_elems // suffix[d + 1])
    for lead in np.ndindex(*shape[:d]):
        for j in range(0, shape[d], step):
            offsets = (*lead, j) + (0,) * (ndim - d - 1)
            sizes = (1,) * d + (min(step, shape[d] - j),) + tuple(shape[d + 1 :])
            start = sum(o * s for o, s in zip(offsets, suffix[1:]))
            yield Box(fqn, offsets, sizes, start)


def batch_boxes(boxes: Iterable[Box], itemsizes: dict[str, int], window: int) -> Iterator[list[Box]]:
    """Group consecutive boxes into batches of at most ``window`` bytes (a big box goes alone)."""
    batch: list[Box] = []
    held = 0
    for box in boxes:
        nbytes = box.numel * itemsizes[box.fqn]
        if batch and held + nbytes > window:
            yield batch
            batch, held = [], 0
        batch.append(box)
        held += nbytes
    if batch:
        yield batch


class _BoxPlanner(LoadPlanner):
    """The few ``LoadPlanner`` calls ``ShardReader.read_data`` makes, aimed at box buffers.

    ``ReadItem.dest_index.index`` is the box's position in the batch; ``dest_offsets`` are
    relative to the box (DCP computes them against the box as the "local chunk").
    """

    def __init__(self, targets: list[torch.Tensor]) -> None:
        self.targets = targets

    def set_up_planner(self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False) -> None:
        raise NotImplementedError("_BoxPlanner only serves ShardReader.read_data")

    def create_local_plan(self) -> LoadPlan:
        raise NotImplementedError("_BoxPlanner only serves ShardReader.read_data")

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        raise NotImplementedError("_BoxPlanner only serves ShardReader.read_data")

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        raise NotImplementedError("_BoxPlanner only serves ShardReader.read_data")

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise NotImplementedError("_BoxPlanner reads tensors only")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        t = self.targets[read_item.dest_index.index]
        for dim, (o, n) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            t = t.narrow(dim, o, n)
        return t

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass


class RegionReader:
    """Read boxes of a checkpoint's tensors, verified, with no process group.

    Args:
        path: checkpoint directory or URL.
        storage_options: passed to fsspec.
        window: the most bytes of tensor data one :meth:`read` should be asked for; the
            reader's merged ranges are capped at it too.
        threads: parallel reader threads.

    Raises:
        CheckpointNotFoundError: ``path`` holds no committed checkpoint.
        InvalidCheckpointError: the index is malformed.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        storage_options: dict[str, Any] | None = None,
        window: int = DEFAULT_WINDOW,
        threads: int = 0,
    ) -> None:
        if window < 1:
            raise ValueError(f"window must be positive, got {window}")
        self.window = window
        self.reader = ShardReader(path, storage_options=storage_options, max_range=window, threads=threads)
        self.index: Index = self.reader.index
        self.url: str = self.reader.backend.url
        self.bytes_read = 0
        self._md: dict[str, TensorStorageMetadata] = {}

    def boxes(self, fqn: str) -> Iterator[Box]:
        """The boxes covering tensor ``fqn``, in row-major order."""
        t = self.index.tensors[fqn]
        return iter_boxes(fqn, t.shape, t.itemsize, self.window)

    def itemsizes(self) -> dict[str, int]:
        return {fqn: t.itemsize for fqn, t in self.index.tensors.items()}

    def _metadata(self, fqn: str) -> TensorStorageMetadata:
        md = self._md.get(fqn)
        if md is None:
            md = self.reader.read_metadata().state_dict_metadata[fqn]
            assert isinstance(md, TensorStorageMetadata)
            self._md[fqn] = md
        return md

    def read(self, boxes: list[Box]) -> list[torch.Tensor]:
        """Read ``boxes``; returns one contiguous tensor per box, in the stored dtype."""
        targets = [torch.empty(b.sizes, dtype=self.index.tensors[b.fqn].dtype) for b in boxes]
        items: list[ReadItem] = []
        for i, box in enumerate(boxes):
            local = ChunkStorageMetadata(offsets=torch.Size(box.offsets), sizes=torch.Size(box.sizes))
            for item in create_read_items_for_chunk_list(box.fqn, self._metadata(box.fqn), [local]):
                items.append(dataclasses.replace(item, dest_index=MetadataIndex(box.fqn, box.offsets, i)))
        if items:
            self.reader.read_data(LoadPlan(items), _BoxPlanner(targets)).wait()
            self.bytes_read += self.reader.bytes_read
        return targets

    def iter_tensor(self, fqn: str) -> Iterator[tuple[Box, torch.Tensor]]:
        """Boxes of one tensor with their data, one read per box."""
        for box in self.boxes(fqn):
            yield box, self.read([box])[0]

    def value(self, name: str) -> Any:
        """A non-tensor value, decoded (msgpack; never executes code)."""
        return unpack_value(self.index.values[name])


# ---------------------------------------------------------------------------------------------
# Summaries (shardstore inspect)


def tensor_summary(fqn: str, t: TensorEntry) -> dict[str, Any]:
    """One tensor's row in ``inspect``: name, dtype, shape, chunks, bytes, compression ratio."""
    raw = int(np.prod(t.sizes, axis=1).sum()) * t.itemsize if len(t.sizes) else 0
    stored = t.stored_nbytes()
    return {
        "name": fqn,
        "dtype": str(t.dtype).removeprefix("torch."),
        "shape": list(t.shape),
        "chunks": int(len(t.pos)),
        "frames": int(len(t.frame_len)),
        "raw_bytes": raw,
        "stored_bytes": stored,
        "ratio": round(raw / stored, 3) if stored else 1.0,
    }


def value_summary(name: str, data: bytes, *, max_repr: int = 80) -> dict[str, Any]:
    """One non-tensor value's row in ``inspect``: name, Python type, a short repr."""
    value = unpack_value(data)
    text = repr(value)
    if len(text) > max_repr:
        text = text[: max_repr - 3] + "..."
    return {"name": name, "type": type(value).__name__, "bytes": len(data), "repr": text}


def summarize(index: Index, url: str) -> dict[str, Any]:
    """Everything ``shardstore inspect`` prints, as plain data (what ``--json`` emits)."""
    tensors = [tensor_summary(fqn, t) for fqn, t in sorted(index.tensors.items())]
    raw = sum(r["raw_bytes"] for r in tensors)
    stored = sum(r["stored_bytes"] for r in tensors)
    return {
        "url": url,
        "world_size": index.world_size,
        "created": index.created,
        "frame_size": index.frame_size,
        "dcp_version": index.dcp_version,
        "files": len(index.files),
        "bases": sorted({f.base for f in index.files if f.base is not None}),
        "raw_bytes": raw,
        "stored_bytes": stored,
        "ratio": round(raw / stored, 3) if stored else 1.0,
        "user": index.user,
        "tensors": tensors,
        "values": [value_summary(k, v) for k, v in sorted(index.values.items())],
    }


# ---------------------------------------------------------------------------------------------
# Diff (shardstore diff)


@dataclass
class TensorDiff:
    """How one tensor present in both checkpoints differs."""

    name: str
    reason: str  # "values", "dtype", "shape"
    max_abs_diff: float | None = None
    a: str = ""
    b: str = ""


@dataclass
class DiffResult:
    """The outcome of :func:`diff_checkpoints`."""

    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    changed: list[TensorDiff] = field(default_factory=list)
    values_changed: list[str] = field(default_factory=list)
    same: int = 0

    @property
    def identical(self) -> bool:
        return not (self.only_a or self.only_b or self.changed or self.values_changed)

    def to_dict(self) -> dict[str, Any]:
        return {
            "identical": self.identical,
            "only_a": self.only_a,
            "only_b": self.only_b,
            "changed": [dataclasses.asdict(c) for c in self.changed],
            "values_changed": self.values_changed,
            "same": self.same,
        }


def _same_bytes_by_hash(ta: TensorEntry, tb: TensorEntry, frame_size_a: int, frame_size_b: int) -> bool:
    """True when both tensors are stored with the same chunks and the same frame checksums."""
    return (
        frame_size_a == frame_size_b
        and ta.dtype == tb.dtype
        and np.array_equal(ta.offsets, tb.offsets)
        and np.array_equal(ta.sizes, tb.sizes)
        and np.array_equal(ta.frame_start, tb.frame_start)
        and np.array_equal(ta.frame_hash, tb.frame_hash)
    )


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> tuple[bool, float]:
    """(bitwise different?, max |a - b|) of two equally shaped boxes; NaN == NaN here."""
    if a.dtype == b.dtype:
        differs = not torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    else:
        differs = True
    if not differs:
        return False, 0.0
    if a.dtype.is_complex or b.dtype.is_complex:
        d = (a.to(torch.complex128) - b.to(torch.complex128)).abs()
    elif a.dtype == torch.bool and b.dtype == torch.bool:
        d = (a != b).to(torch.float64)
    else:
        da, db = a.to(torch.float64), b.to(torch.float64)
        d = (da - db).abs()
        both_nan = da.isnan() & db.isnan()
        d = torch.where(both_nan | (da == db), torch.zeros((), dtype=torch.float64), d)
    return True, float(d.max()) if d.numel() else 0.0  # NaN where only one side is NaN


def diff_checkpoints(
    a: RegionReader, b: RegionReader, *, progress: Progress | None = None
) -> DiffResult:
    """Compare two checkpoints tensor by tensor, streaming boxes of at most ``a.window`` bytes.

    Tensors stored with identical chunks and frame checksums are equal without reading them.
    Tensors whose dtypes differ are compared after a cast to float64.
    """
    progress = progress or silent()
    result = DiffResult()
    ia, ib = a.index, b.index
    result.only_a = sorted(set(ia.tensors) - set(ib.tensors))
    result.only_b = sorted(set(ib.tensors) - set(ia.tensors))
    result.only_a += sorted(set(ia.values) - set(ib.values))
    result.only_b += sorted(set(ib.values) - set(ia.values))
    for name in sorted(set(ia.values) & set(ib.values)):
        if unpack_value(ia.values[name]) != unpack_value(ib.values[name]):
            result.values_changed.append(name)
    for fqn in sorted(set(ia.tensors) & set(ib.tensors)):
        ta, tb = ia.tensors[fqn], ib.tensors[fqn]
        nbytes = math.prod(ta.shape) * ta.itemsize
        if ta.shape != tb.shape:
            result.changed.append(TensorDiff(fqn, "shape", None, str(list(ta.shape)), str(list(tb.shape))))
            progress.update(nbytes)
            continue
        if _same_bytes_by_hash(ta, tb, ia.frame_size, ib.frame_size):
            result.same += 1
            progress.update(nbytes)
            continue
        differs, worst = False, 0.0
        for box in a.boxes(fqn):
            (xa,), (xb,) = a.read([box]), b.read([box])
            d, m = _max_abs_diff(xa, xb)
            differs |= d
            worst = math.nan if math.isnan(m) or math.isnan(worst) else max(worst, m)
            progress.update(box.numel * ta.itemsize)
        if ta.dtype != tb.dtype:
            a_dt, b_dt = str(ta.dtype).removeprefix("torch."), str(tb.dtype).removeprefix("torch.")
            result.changed.append(TensorDiff(fqn, "dtype", worst, a_dt, b_dt))
        elif differs:
            result.changed.append(TensorDiff(fqn, "values", worst))
        else:
            result.same += 1
    return result
