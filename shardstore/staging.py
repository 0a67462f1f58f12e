"""Async save, stage 1: copy the state into host staging memory that is reused across saves.

An async save must not let the training loop change what is being written, so the caller is
blocked while every tensor of the state dict is copied into host memory; serializing, hashing,
compressing, writing and committing then run in the background from that copy
(:mod:`shardstore.async_save`). This module is that copy, in two forms:

* :class:`StagingBuffers` copies the whole state into one host arena. The arena is allocated by
  the first save and reused by every later save whose state has the same structure (the same
  tensor shapes and dtypes, in the same order); it is re-allocated only when that changes. Fresh
  buffers per save are what makes host memory grow (and pinned allocations slow) in long jobs.
  The arena is reused only when nothing else still references its tensors (a previous save that
  has not let go of them, or a process executor that moved them into shared memory): then a new
  one is allocated rather than overwriting memory that someone may still read.
* :class:`SlicingPlanner` + :class:`SlicePool` cap the extra memory below the state size: DCP's
  ``resolve_data`` copies each item into a slice of a fixed-size pool just before the writer
  needs it, and the slice returns to the pool when the writer drops the tensor. The caller is
  then blocked until the last item has been copied (most of the save), which is the price of the
  cap.

State on a GPU is copied into pinned host memory (``cudaHostRegister`` on the arena, no
power-of-two rounding) with non-blocking copies on a side stream that first waits for the
compute stream, so the copy sees every value computed before the call; the caller returns once
that stream has finished. On CPU the arena is plain memory.

:class:`AsyncStagerMixin` makes a DCP ``StorageWriter`` an ``AsyncStager``, so that
``dcp.async_save(sd, storage_writer=ShardWriter(p))`` stages through the same process-wide
buffers (:func:`default_slot`), and waits for the previous save that used them.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import logging
import mmap
import sys
import threading
import weakref
from typing import Any, Callable, Iterator, Protocol

import torch
from torch.distributed._shard.sharded_tensor import Shard as ShardedTensorShard
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor

from shardstore.errors import UnsupportedValueError

logger = logging.getLogger(__name__)

#: Offsets of tensors inside an arena or pool are multiples of this (cache line, any dtype).
ALIGN = 64

_ATOMS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# -- host memory --------------------------------------------------------------------------------


class _HostArena:
    """One flat block of host memory, pinned (page-locked) when ``pin`` is set."""

    def __init__(self, nbytes: int, *, pin: bool) -> None:
        self.nbytes = nbytes
        self.pinned = pin
        self.data = torch.empty(max(nbytes, 1), dtype=torch.uint8)
        if pin:
            # Fault the pages in first, with torch's parallel fill: cudaHostRegister of untouched
            # memory faults them one by one (an 8 GiB arena on an H200 host: 2.6 s to register
            # untouched, 0.8 s filled then registered).
            self.data.fill_(0)
            import torch.cuda._pin_memory_utils as pin_utils

            pin_utils.pin_memory(self.data.data_ptr(), self.data.nbytes)
            weakref.finalize(self.data, pin_utils.unpin_memory, self.data.data_ptr()).atexit = False

    def view(self, offset: int, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        n = shape.numel() * torch.empty((), dtype=dtype).element_size()
        return self.data[offset : offset + n].view(dtype).view(shape)


def _wants_pin(t: torch.Tensor) -> bool:
    return t.device.type == "cuda" and torch.cuda.is_available()


def _copy_all(pairs: list[tuple[torch.Tensor, torch.Tensor]], streams: dict[int, Any]) -> None:
    """``dst.copy_(src)`` for every pair; GPU sources on a side stream per device, then wait."""
    used = []
    for dst, src in pairs:
        if src.device.type != "cuda":
            dst.copy_(src)
            continue
        index = src.device.index if src.device.index is not None else torch.cuda.current_device()
        stream = streams.get(index)
        if stream is None:
            stream = streams[index] = torch.cuda.Stream(device=index)
        if stream not in used:
            stream.wait_stream(torch.cuda.current_stream(index))  # values computed before the call
            used.append(stream)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
    for stream in used:
        stream.synchronize()


# -- walking a state dict -----------------------------------------------------------------------


def _collect(obj: Any, out: list[torch.Tensor], path: str) -> None:
    """Append the local tensors of ``obj`` in the order :func:`_rebuild` consumes them."""
    if isinstance(obj, DTensor):
        out.append(_check_strided(obj._local_tensor, path))
    elif isinstance(obj, ShardedTensor):
        out.extend(_check_strided(s.tensor, path) for s in obj.local_shards())
    elif isinstance(obj, torch.Tensor):
        out.append(_check_strided(obj, path))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _collect(v, out, f"{path}.{k}" if path else str(k))
    elif isinstance(obj, (list, tuple)) and not isinstance(obj, _ATOMS):
        for i, v in enumerate(obj):
            _collect(v, out, f"{path}[{i}]")


def _check_strided(t: torch.Tensor, path: str) -> torch.Tensor:
    if t.layout != torch.strided or t.device.type == "meta":
        raise UnsupportedValueError(f"cannot stage {path!r} for an async save: {t.layout} tensor on {t.device}")
    return t


def _rebuild(obj: Any, bufs: Iterator[torch.Tensor]) -> Any:
    """A copy of ``obj`` whose tensors are the staged ``bufs`` (same order as :func:`_collect`)."""
    if isinstance(obj, DTensor):
        return DTensor(next(bufs), obj._spec, requires_grad=False)
    if isinstance(obj, ShardedTensor):
        return _rebuild_sharded(obj, bufs)
    if isinstance(obj, torch.Tensor):
        return next(bufs)
    if type(obj) is dict:
        return {k: _rebuild(v, bufs) for k, v in obj.items()}
    if isinstance(obj, dict):
        out = copy.copy(obj)
        for k, v in obj.items():
            out[k] = _rebuild(v, bufs)
        return out
    if isinstance(obj, _ATOMS):
        return obj
    if isinstance(obj, list):
        return [_rebuild(v, bufs) for v in obj]
    if isinstance(obj, tuple):
        items = [_rebuild(v, bufs) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, io.BytesIO):
        return io.BytesIO(obj.getvalue())
    return copy.deepcopy(obj)


def _rebuild_sharded(obj: ShardedTensor, bufs: Iterator[torch.Tensor]) -> ShardedTensor:
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed.remote_device import _remote_device

    def on_cpu(m: ShardMetadata) -> ShardMetadata:
        return dataclasses.replace(m, placement=_remote_device(f"rank:{m.placement.rank()}/cpu"))

    meta = copy.copy(obj.metadata())
    meta.shards_metadata = [on_cpu(m) for m in meta.shards_metadata]
    shards = [ShardedTensorShard(next(bufs), on_cpu(s.metadata)) for s in obj.local_shards()]
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        shards, meta, process_group=obj._process_group
    )


# -- whole-state staging ------------------------------------------------------------------------


class StagingBuffers:
    """Host copies of a state dict's tensors in one arena, reused while the structure is unchanged.

    Attributes:
        allocations: how many times an arena was allocated (1 after any number of saves of a state
            whose structure does not change).
    """

    def __init__(self) -> None:
        self._arena: _HostArena | None = None
        self._signature: tuple | None = None
        self._buffers: list[torch.Tensor] = []
        self._streams: dict[int, Any] = {}
        self.allocations = 0

    @property
    def nbytes(self) -> int:
        """Bytes of host memory held (0 before the first save)."""
        return self._arena.nbytes if self._arena is not None else 0

    @property
    def pinned(self) -> bool:
        return self._arena is not None and self._arena.pinned

    def release(self) -> None:
        """Drop the arena (the next :meth:`stage` allocates a new one)."""
        self._arena, self._signature, self._buffers = None, None, []

    def in_use(self) -> bool:
        """Whether anything besides this object still references the staged tensors."""
        for i in range(len(self._buffers)):
            # getrefcount sees the list's reference and its own argument: 2 means ours alone.
            if sys.getrefcount(self._buffers[i]) > 2 or self._buffers[i].is_shared():
                return True
        return False

    @torch.no_grad()
    def stage(self, state_dict: Any) -> Any:
        """Copy ``state_dict`` into the staging arena and return the staged copy.

        Tensors (plain, DTensor, ShardedTensor) are copied into the arena; containers are
        rebuilt; other values are deep-copied, so the result holds the values at the call.

        Raises:
            UnsupportedValueError: a tensor cannot be staged (sparse or meta).
        """
        leaves: list[torch.Tensor] = []
        _collect(state_dict, leaves, "")
        signature = tuple((t.shape, t.dtype, _wants_pin(t)) for t in leaves)
        if signature != self._signature:
            self._allocate(leaves, signature, "the state's structure changed" if self._signature else "first save")
        elif self.in_use():
            self._allocate(leaves, signature, "the previous staged copy is still referenced")
        _copy_all(list(zip(self._buffers, leaves)), self._streams)
        return _rebuild(state_dict, iter(self._buffers))

    def _allocate(self, leaves: list[torch.Tensor], signature: tuple, why: str) -> None:
        self.release()  # drop the old arena first: peak memory stays at one arena
        offsets, total = [], 0
        for t in leaves:
            offsets.append(total)
            total += _aligned(_nbytes(t))
        arena = _HostArena(total, pin=any(_wants_pin(t) for t in leaves))
        self._buffers = [arena.view(o, t.shape, t.dtype) for o, t in zip(offsets, leaves)]
        self._arena, self._signature = arena, signature
        self.allocations += 1
        logger.info(
            "allocated %.1f MB of %sstaging memory for %d tensors (%s)",
            total / 1e6, "pinned " if arena.pinned else "", len(leaves), why,
        )


# -- the save that uses the buffers -------------------------------------------------------------


class InFlight(Protocol):
    """A background save: ``done()`` without blocking, ``join()`` until it ends (never raises)."""

    def done(self) -> bool: ...

    def join(self) -> None: ...


class _ThreadSave:
    """A save running on a DCP executor thread."""

    def __init__(self, thread: threading.Thread) -> None:
        self.thread = thread

    def done(self) -> bool:
        return not self.thread.is_alive()

    def join(self) -> None:
        self.thread.join()


class StagingSlot:
    """A process's staging buffers and the one save (at most) that is reading them."""

    def __init__(self) -> None:
        self.buffers = StagingBuffers()
        self.lock = threading.Lock()
        self.inflight: InFlight | None = None
        self._dcp_threads_before: set[threading.Thread] | None = None

    def wait_idle(self) -> None:
        """Block until the save using the buffers (if any) has finished."""
        inflight = self.inflight
        if inflight is not None:
            if not inflight.done():
                logger.info("waiting for the previous async save to finish before staging")
            inflight.join()
        self.inflight = None

    # DCP path: dcp.async_save calls stage(), starts its executor thread, then synchronize_staging().

    def stage_for_dcp(self, state_dict: Any) -> Any:
        with self.lock:
            self.wait_idle()
            self._dcp_threads_before = set(threading.enumerate())
            return self.buffers.stage(state_dict)

    def track_dcp_save(self) -> None:
        """Find the executor thread DCP just started for the staged state, to wait for it later."""
        with self.lock:
            before, self._dcp_threads_before = self._dcp_threads_before, None
            if before is None:
                return
            new = [
                t for t in threading.enumerate()
                if t not in before and t.name.startswith("AsyncCheckpointExecutor")
            ]
            if len(new) == 1:
                self.inflight = _ThreadSave(new[0])
            else:  # finished already, or a process executor: reuse is guarded by in_use()
                logger.debug("dcp.async_save: %d new executor threads; not tracking this save", len(new))


_DEFAULT_SLOT = StagingSlot()


def default_slot() -> StagingSlot:
    """The process-wide staging slot shared by ``dcp.async_save`` and ``shardstore.async_save``."""
    return _DEFAULT_SLOT


class AsyncStagerMixin(AsyncStager):
    """Make a DCP ``StorageWriter`` an ``AsyncStager`` that stages into reused buffers.

    ``dcp.async_save(sd, storage_writer=writer)`` calls :meth:`stage` on the caller's thread (the
    only part that blocks), runs ``dcp.save`` of the staged copy on its executor thread, then
    calls :meth:`synchronize_staging`. A second ``dcp.async_save`` waits in :meth:`stage` until
    the previous one has finished with the buffers.

    DCP runs the background save's collectives on the ``process_group`` given to
    ``dcp.async_save`` (default: the default group). To keep them apart from the training job's
    collectives pass ``process_group=shardstore.async_save.save_process_group()``.
    """

    _synchronize_after_execute: bool = True

    def stage(self, state_dict: Any) -> Any:
        return default_slot().stage_for_dcp(state_dict)

    def synchronize_staging(self) -> None:
        default_slot().track_dcp_save()

    def close(self) -> None:
        """Nothing to release: the buffers belong to the process (see :func:`default_slot`)."""


# -- bounded staging ----------------------------------------------------------------------------


class SlicePool:
    """A fixed host pool that staged items borrow slices of; a slice returns when its tensor dies.

    A request waits until a large enough free range exists. An item larger than the pool, or a
    request that could otherwise never be met (every borrowed slice is held by a thread that is
    itself waiting), gets memory of its own outside the pool, so a save never deadlocks; it is
    counted in ``outside``. A writer thread may still reference the item it wrote last while it
    asks for the next one (``ShardWriter`` does), so the peak is about
    ``max(capacity, 2 * writer threads * largest item)``.

    Args:
        capacity: pool size in bytes.
        pin: page-lock the pool (state on a GPU).
    """

    def __init__(self, capacity: int, *, pin: bool) -> None:
        if capacity < ALIGN:
            raise ValueError(f"max_staging_bytes must be at least {ALIGN}, got {capacity}")
        self.capacity = _aligned(capacity)
        self.pinned = pin
        self._arena = _HostArena(self.capacity, pin=pin)
        self._base = self._arena.data.numpy()
        self._free: list[tuple[int, int]] = [(0, self.capacity)]
        self._owners: dict[int, int] = {}  # slice offset -> thread id of the borrower
        self._waiting: set[int] = set()
        self._cond = threading.Condition()
        self.outside = 0  # allocations made outside the pool

    @classmethod
    def for_state(cls, state_dict: Any, capacity: int) -> SlicePool:
        """A pool for saves of ``state_dict`` (pinned if it is on a GPU), every page touched."""
        leaves: list[torch.Tensor] = []
        _collect(state_dict, leaves, "")
        pool = cls(capacity, pin=any(_wants_pin(t) for t in leaves))
        pool._arena.data.zero_()  # fault the pages in now, not during the first save's copies
        return pool

    def borrow(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized tensor in the pool (blocks until there is room)."""
        n = _aligned(shape.numel() * torch.empty((), dtype=dtype).element_size()) or ALIGN
        me = threading.get_ident()
        with self._cond:
            while True:
                offset = self._take(n) if n <= self.capacity else None
                if offset is not None:
                    self._owners[offset] = me
                    break
                if all(owner in self._waiting | {me} for owner in self._owners.values()):
                    self.outside += 1
                    logger.debug("staging %d bytes outside the %d-byte pool", n, self.capacity)
                    return _outside_pool(shape, dtype, pin=self.pinned)
                self._waiting.add(me)
                try:
                    self._cond.wait()
                finally:
                    self._waiting.discard(me)
        piece = self._base[offset : offset + n]
        weakref.finalize(piece, self._give, offset, n)
        nelem = shape.numel()
        return torch.from_numpy(piece).view(dtype)[:nelem].view(shape)

    def _take(self, n: int) -> int | None:
        for i, (start, length) in enumerate(self._free):
            if length >= n:
                if length == n:
                    del self._free[i]
                else:
                    self._free[i] = (start + n, length - n)
                return start
        return None

    def _give(self, offset: int, n: int) -> None:
        with self._cond:
            self._owners.pop(offset, None)
            free = self._free
            free.append((offset, n))
            free.sort()
            merged = [free[0]]
            for start, length in free[1:]:
                last_start, last_len = merged[-1]
                if last_start + last_len == start:
                    merged[-1] = (last_start, last_len + length)
                else:
                    merged.append((start, length))
            self._free = merged
            self._cond.notify_all()


def _outside_pool(shape: torch.Size, dtype: torch.dtype, *, pin: bool) -> torch.Tensor:
    """Memory for one item that does not fit the pool, returned to the OS when the tensor dies.

    Anonymous ``mmap`` rather than ``malloc``: glibc keeps freed chunks of this size in its heap,
    which would leave the process's memory above the cap after the save.
    """
    if pin:
        return torch.empty(shape, dtype=dtype, pin_memory=True)  # CUDA's host cache reuses it
    nbytes = shape.numel() * torch.empty((), dtype=dtype).element_size()
    raw = torch.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=torch.uint8)
    return raw[:nbytes].view(dtype).view(shape)


class SlicingPlanner(SavePlanner):
    """Wrap a ``SavePlanner`` so each item is copied into a :class:`SlicePool` when resolved.

    ``on_staged`` is called once every item of this rank's final plan has been copied: from then
    on the live state may change without affecting the checkpoint.
    """

    def __init__(self, inner: SavePlanner, pool: SlicePool, on_staged: Callable[[], None]) -> None:
        self.inner = inner
        self.pool = pool
        self._on_staged = on_staged
        self._remaining = -1
        self._lock = threading.Lock()
        self._streams: dict[int, Any] = {}
        self._ready: dict[int, Any] = {}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            index = torch.cuda.current_device()  # mark "values computed before the call"
            self._ready[index] = torch.cuda.Event()
            self._ready[index].record(torch.cuda.current_stream(index))

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (copy/unpickle): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def set_up_planner(self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False) -> None:
        self.inner.set_up_planner(state_dict=state_dict, storage_meta=storage_meta, is_coordinator=is_coordinator)

    def create_local_plan(self) -> SavePlan:
        return self.inner.create_local_plan()

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Any]:
        return self.inner.create_global_plan(all_plans)

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        plan = self.inner.finish_plan(new_plan)
        self._count(set_total=len(plan.items))
        return plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        data = self.inner.resolve_data(write_item)
        if isinstance(data, torch.Tensor):
            data = self._copy(data)
        self._count()
        return data

    @torch.no_grad()
    def _copy(self, src: torch.Tensor) -> torch.Tensor:
        dst = self.pool.borrow(src.shape, src.dtype)
        if src.device.type == "cuda":
            index = src.device.index if src.device.index is not None else torch.cuda.current_device()
            with self._lock:
                stream = self._streams.get(index)
                if stream is None:
                    stream = self._streams[index] = torch.cuda.Stream(device=index)
            if index in self._ready:
                stream.wait_event(self._ready[index])
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
            stream.synchronize()
        else:
            dst.copy_(src)
        return dst

    def _count(self, set_total: int | None = None) -> None:
        with self._lock:
            if set_total is not None:
                self._remaining += set_total + 1
            else:
                self._remaining -= 1
            done = self._remaining == 0
        if done:
            self._on_staged()
