"""Async save: stage on the caller's thread, then write and commit in the background.

One :func:`async_save`, on every rank::

    caller thread:  settle the previous save (wait for it, or refuse; raise its unreported error)
                    -> Stateful.state_dict() -> copy the tensors into staging memory (staging.py)
                    -> hand the staged copy to the background thread and return a handle
    background:     dcp.save(staged copy, storage_writer=ShardWriter) on a dedicated gloo group
                    -> plan, write each rank's files, coordinator publishes the index (commit)
    handle.wait():  returns DCP's Metadata, or raises the background's exception (once)

Why a thread and not a process: the background work is torch copies, ``os.write``/``pwrite``,
xxhash and zstandard, all of which release the GIL; the GIL is held only by DCP's planning and
the Python glue around each frame. A thread shares the staging memory with the caller (no
pickling, no shared-memory transfer) and the process's gloo context. ``bench_async`` measures the
training loop's throughput while a save runs.

Why a dedicated process group: DCP's save runs gather/scatter/broadcast collectives. Issued from a
second thread on the training job's group they could interleave with the training's own
collectives (ranks pair up the wrong calls: a hang or garbage). A separate gloo group (gloo: the
staged copy is on the CPU) keeps them apart. It is created once, at the first save, on every
rank of the save's group, because creating a group is itself collective.

Errors are never lost and never raised twice: a background exception is logged, stored, and
raised by ``handle.wait()`` or else by the next save (which then does not start). DCP fails a
save on every rank when one rank fails, and ``ShardWriter.finish`` (the commit) runs only when
all ranks have written their data, so a failed save publishes no index. A rank whose staging fails
raises at once, and its background still takes part in the save's first collective with that
failure, so the other ranks fail too (on ``wait()``) instead of hanging.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.checkpoint.storage import StorageWriter

from shardstore.errors import AsyncSaveInProgressError, ShardstoreError
from shardstore.staging import SlicePool, SlicingPlanner, StagingSlot, default_slot

logger = logging.getLogger(__name__)

__all__ = [
    "AsyncSaveHandle",
    "AsyncSaveInProgressError",
    "AsyncSaver",
    "async_save",
    "default_saver",
    "prepare",
    "save_process_group",
]


# -- the dedicated process groups -----------------------------------------------------------------

_groups: dict[tuple[tuple[int, ...], str], dist.ProcessGroup] = {}
_groups_world: Any = None
_groups_lock = threading.Lock()


def save_process_group(process_group: dist.ProcessGroup | None = None, *, purpose: str = "save") -> dist.ProcessGroup:
    """The gloo group async saves over ``process_group``'s ranks use for their collectives.

    Created on first use and cached (per default group, so a re-initialised job gets new ones).
    Creating a group is collective: call this at the same point on every rank of
    ``process_group`` (``async_save`` does, at its first call). Pass the result as
    ``process_group`` to ``dcp.async_save`` to keep its collectives apart from the training's.

    Args:
        process_group: the ranks that save together (default: all ranks).
        purpose: a separate group per purpose (``"save"``; ``"control"`` for busy checks).
    """
    global _groups_world
    world = dist.group.WORLD
    with _groups_lock:
        if _groups_world is not world:
            _groups.clear()
            _groups_world = world
        ranks = tuple(range(dist.get_world_size())) if process_group is None else tuple(
            dist.get_process_group_ranks(process_group)
        )
        key = (ranks, purpose)
        if key not in _groups:
            whole = len(ranks) == dist.get_world_size()
            _groups[key] = dist.new_group(
                ranks=None if whole else list(ranks),
                backend="gloo",
                use_local_synchronization=not whole,  # non-members of a sub-group never call this
                group_desc=f"shardstore_async_{purpose}",
            )
            logger.debug("created gloo group for async %s over ranks %s", purpose, ranks)
        return _groups[key]


# -- the handle -----------------------------------------------------------------------------------


class AsyncSaveHandle:
    """A save running in the background, returned by :func:`async_save`.

    Attributes:
        url: where the checkpoint is being written.
        blocked_seconds: how long the call blocked the caller (settling the previous save and
            staging).
        staged_bytes: host memory holding the staged copy.
    """

    def __init__(self, future: concurrent.futures.Future, *, url: str, blocked_seconds: float = 0.0,
                 staged_bytes: int = 0) -> None:
        self._future = future
        self._lock = threading.Lock()
        self._reported = False
        self.url = url
        self.blocked_seconds = blocked_seconds
        self.staged_bytes = staged_bytes

    def done(self) -> bool:
        """Whether the background save has finished (committed or failed)."""
        return self._future.done()

    def join(self) -> None:
        """Block until the background save has finished; never raises its error."""
        concurrent.futures.wait([self._future])

    def wait(self, timeout: float | None = None) -> Metadata | None:
        """Block until the save has finished; raise its error if it failed and was not yet raised.

        Args:
            timeout: seconds to wait at most (``None``: no limit).

        Returns:
            DCP's ``Metadata`` of the committed checkpoint; ``None`` for a failed save whose error
            was already raised (by an earlier ``wait()`` or the next save).

        Raises:
            TimeoutError: still running after ``timeout`` seconds.
            CheckpointException: the save failed (on some rank; every rank raises it).
        """
        done, _ = concurrent.futures.wait([self._future], timeout=timeout)
        if not done:
            raise TimeoutError(f"async save to {self.url} still running after {timeout} s")
        error = self._take_error()
        if error is not None:
            raise error
        return None if self._future.exception() is not None else self._future.result()

    def _take_error(self) -> BaseException | None:
        """The background error, the first time it is asked for (then ``None``)."""
        error = self._future.exception()
        with self._lock:
            if error is None or self._reported:
                return None
            self._reported = True
        return error

    def _mark_reported(self) -> None:
        with self._lock:
            self._reported = True


# -- background work ------------------------------------------------------------------------------


class _StagingFailed(SavePlanner):
    """Planner of a rank whose staging failed: fails DCP's first collective step on every rank."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def set_up_planner(self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False) -> None:
        raise ShardstoreError(f"could not stage the state for the async save: {self.error}") from self.error

    def create_local_plan(self) -> SavePlan:
        raise AssertionError("unreachable")

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        raise AssertionError("unreachable")

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        raise AssertionError("unreachable")

    def resolve_data(self, write_item: WriteItem) -> Any:
        raise AssertionError("unreachable")


def _drop_frames(error: BaseException) -> None:
    """Free the locals of the frames an exception's tracebacks hold (they hold the staged state)."""
    seen, todo = set(), [error]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        todo.extend(x for x in (e.__cause__, e.__context__) if x is not None)
        if isinstance(e, CheckpointException):
            todo.extend(f[0] for f in e.failures.values() if isinstance(f, tuple) and f)


def _background_save(box: list[Any], writer: Any, planner: SavePlanner | None, group: Any, use_dist: bool,
                     url: str, on_exit: Callable[[], None] | None) -> Metadata:
    state = box.pop()  # the only reference besides this frame: dropped before the future completes
    t0 = time.perf_counter()
    try:
        metadata = dcp.save(state, storage_writer=writer, planner=planner, process_group=group, no_dist=not use_dist)
    except BaseException as e:
        state = None
        _drop_frames(e)
        logger.error("async save to %s failed after %.2f s: %s", url, time.perf_counter() - t0, e)
        raise
    finally:
        state = None
        if on_exit is not None:
            on_exit()
    logger.info("async save to %s committed in the background in %.2f s", url, time.perf_counter() - t0)
    return metadata


# -- the saver ------------------------------------------------------------------------------------


class AsyncSaver:
    """Runs async saves one at a time, staging through reused host memory.

    Args:
        if_busy: what a save does while the previous one is still running: ``"wait"`` for it, or
            ``"raise"`` :class:`AsyncSaveInProgressError` (decided together by all ranks, so
            they all refuse or all proceed).
        max_staging_bytes: cap the host memory used for staging (a fixed pool of this size);
            the call then blocks until the last item is copied, i.e. for most of the save.
            ``None``: stage the whole state at once, blocking only for that copy.
        slot: the staging buffers to use (default: the process-wide ones, shared with
            ``dcp.async_save`` through :class:`~shardstore.ShardWriter`).

    Staging buffers are reused only when nothing else still references the previous staged
    copy. DCP's ``DefaultSavePlanner`` keeps the state it planned until its next save, so pass
    ``planner=None`` or a new planner per save; a planner kept across saves makes every save
    allocate new buffers (memory stays bounded, the copy gets slower).
    """

    def __init__(self, *, if_busy: str = "wait", max_staging_bytes: int | None = None,
                 slot: StagingSlot | None = None) -> None:
        if if_busy not in ("wait", "raise"):
            raise ValueError(f"if_busy must be 'wait' or 'raise', got {if_busy!r}")
        if max_staging_bytes is not None and max_staging_bytes < 1:
            raise ValueError(f"max_staging_bytes must be positive, got {max_staging_bytes}")
        self.if_busy = if_busy
        self.max_staging_bytes = max_staging_bytes
        self.slot = slot if slot is not None else default_slot()
        self.pool: SlicePool | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._last: AsyncSaveHandle | None = None
        self._lock = threading.Lock()

    def save(self, state_dict: dict[str, Any], *, storage_writer: StorageWriter, planner: SavePlanner | None = None,
             process_group: dist.ProcessGroup | None = None) -> AsyncSaveHandle:
        """Stage ``state_dict`` and save it in the background; see :func:`async_save`."""
        t0 = time.perf_counter()
        use_dist = dist.is_available() and dist.is_initialized()
        group = save_process_group(process_group) if use_dist else None
        control = save_process_group(process_group, purpose="control") if use_dist and self.if_busy == "raise" else None
        url = str(getattr(storage_writer, "path", storage_writer))
        with self._lock:
            self._settle_previous(control)
            with self.slot.lock:
                self.slot.wait_idle()
                state = {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state_dict.items()}
                if self.max_staging_bytes is None:
                    handle = self._start_staged(state, storage_writer, planner, group, use_dist, url, t0)
                else:
                    handle = self._start_sliced(state, storage_writer, planner, group, use_dist, url, t0)
                self.slot.inflight = handle
            self._last = handle
        logger.info(
            "async save to %s: caller blocked %.3f s, %.1f MB staged",
            url, handle.blocked_seconds, handle.staged_bytes / 1e6,
        )
        return handle

    def prepare(self, state_dict: dict[str, Any], *, process_group: dist.ProcessGroup | None = None) -> int:
        """Allocate and touch the staging memory for ``state_dict`` now, and create the save's group.

        A first save otherwise pays for both (fresh memory is page-faulted while it is copied
        into, several times slower than a copy into memory already used). Call it on every rank
        of ``process_group`` (creating the group is collective), e.g. before training starts.

        Returns:
            Bytes of staging memory held.
        """
        if dist.is_available() and dist.is_initialized():
            save_process_group(process_group)
            if self.if_busy == "raise":
                save_process_group(process_group, purpose="control")
        with self._lock, self.slot.lock:
            self.slot.wait_idle()
            state = {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state_dict.items()}
            if self.max_staging_bytes is not None:
                if self.pool is None:
                    self.pool = SlicePool.for_state(state, self.max_staging_bytes)
                return self.pool.capacity
            self.slot.buffers.stage(state)  # the copy is what touches every page
            return self.slot.buffers.nbytes

    def wait(self) -> Metadata | None:
        """Wait for the last save; raise its error if not yet raised. ``None`` if there was none."""
        with self._lock:
            last, self._last = self._last, None
        return last.wait() if last is not None else None

    def close(self) -> None:
        """Wait for the last save (raising its error) and stop the background thread."""
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None

    # -- internals --

    def _submit(self, *args: Any) -> concurrent.futures.Future:
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="shardstore-async-save")
        return self._executor.submit(_background_save, *args)

    def _settle_previous(self, control: Any) -> None:
        prev = self._last
        if prev is None:
            return
        if self.if_busy == "raise":
            busy = torch.tensor([0 if prev.done() else 1], dtype=torch.int32)
            if control is not None:
                dist.all_reduce(busy, op=dist.ReduceOp.MAX, group=control)
            if busy.item():
                raise AsyncSaveInProgressError(
                    f"the previous async save (to {prev.url}) is still running on at least one rank; "
                    "wait() for it, or use if_busy='wait'"
                )
        prev.join()
        self._last = None
        error = prev._take_error()
        if error is not None:
            raise error

    def _start_staged(self, state: dict[str, Any], writer: Any, planner: SavePlanner | None, group: Any,
                      use_dist: bool, url: str, t0: float) -> AsyncSaveHandle:
        try:
            staged = self.slot.buffers.stage(state)
        except Exception as e:
            # Join the save anyway, failing it, so the other ranks fail instead of hanging.
            future = self._submit([{}], writer, _StagingFailed(e), group, use_dist, url, None)
            handle = AsyncSaveHandle(future, url=url, blocked_seconds=time.perf_counter() - t0)
            handle._mark_reported()  # raised right here, on this rank
            self.slot.inflight = handle
            self._last = handle
            raise
        future = self._submit([staged], writer, planner, group, use_dist, url, None)
        del staged
        return AsyncSaveHandle(future, url=url, blocked_seconds=time.perf_counter() - t0,
                               staged_bytes=self.slot.buffers.nbytes)

    def _start_sliced(self, state: dict[str, Any], writer: Any, planner: SavePlanner | None, group: Any,
                      use_dist: bool, url: str, t0: float) -> AsyncSaveHandle:
        if self.pool is None:
            self.pool = SlicePool.for_state(state, self.max_staging_bytes)
        staged = threading.Event()
        sliced = SlicingPlanner(planner if planner is not None else DefaultSavePlanner(), self.pool, staged.set)
        future = self._submit([state], writer, sliced, group, use_dist, url, staged.set)
        staged.wait()
        return AsyncSaveHandle(future, url=url, blocked_seconds=time.perf_counter() - t0,
                               staged_bytes=self.pool.capacity)


_default_saver: AsyncSaver | None = None
_default_lock = threading.Lock()


def default_saver() -> AsyncSaver:
    """The process-wide saver behind :func:`async_save` (waits when busy; whole-state staging)."""
    global _default_saver
    with _default_lock:
        if _default_saver is None:
            _default_saver = AsyncSaver()
        return _default_saver


def prepare(state_dict: dict[str, Any], *, process_group: dist.ProcessGroup | None = None) -> int:
    """Set up :func:`async_save`'s staging memory and group ahead of the first save (all ranks).

    See :meth:`AsyncSaver.prepare`. Returns the bytes of staging memory held.
    """
    return default_saver().prepare(state_dict, process_group=process_group)


def async_save(state_dict: dict[str, Any], *, storage_writer: StorageWriter, planner: SavePlanner | None = None,
               process_group: dist.ProcessGroup | None = None) -> AsyncSaveHandle:
    """Save ``state_dict`` in the background; return once its values are copied to host memory.

    Call it on every rank of ``process_group``, like ``dcp.save``. The checkpoint holds the values
    at the call, whatever the caller does to the tensors afterwards. At most one save runs at a
    time: this call first waits for the previous one (see :class:`AsyncSaver` to refuse instead).

    Args:
        state_dict: what to save (tensors, DTensors, ShardedTensors, DCP ``Stateful`` objects,
            plain values), as for ``dcp.save``.
        storage_writer: where to save, normally a :class:`~shardstore.ShardWriter`.
        planner: a DCP ``SavePlanner`` (default: DCP's ``DefaultSavePlanner``).
        process_group: the ranks that save together (default: all). The save's collectives run
            on a dedicated gloo group over the same ranks (:func:`save_process_group`).

    Returns:
        An :class:`AsyncSaveHandle`; ``handle.wait()`` blocks until the checkpoint is committed.

    Raises:
        Exception: the previous save's error, if it failed and nobody called ``wait()`` on it
            (this save then does not start); a staging error on this rank.

    Example:
        >>> handle = async_save({"app": app_state}, storage_writer=ShardWriter(f"/ckpt/step-{step}"))
        >>> ...  # train on
        >>> handle.wait()
    """
    return default_saver().save(state_dict, storage_writer=storage_writer, planner=planner,
                                process_group=process_group)
