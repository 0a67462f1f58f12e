"""CheckpointManager: one checkpoint per step under a root, retention, restore on any world size.

This is the stage above both data flows: a training loop calls :meth:`CheckpointManager.save`
every N steps and :meth:`CheckpointManager.restore` after a crash or preemption; underneath,
each step is a normal shardstore checkpoint written by :class:`~shardstore.ShardWriter` and read
by :class:`~shardstore.ShardReader` through DCP, so everything they guarantee (verified reads,
resharding to any world size, atomic commit) holds per step.

Layout::

    <root>/step-<step:012d>/index.shardstore   the commit record of that step
    <root>/step-<step:012d>/data-*.bin         its data files
    <root>/_lease/                             the write lease (shardstore/lease.py)

Commit protocol. A step is committed exactly when its index exists; the index is published last
and atomically by the writer. :meth:`~CheckpointManager.steps` lists only steps with an index,
so a reader never sees a half-written step, whatever instant a save was killed at.

Deletion protocol (coordinator only, never on other ranks):

* It runs after a save has committed (in a background thread), so a failed save never deletes
  anything, and the newest committed step always survives.
* Retention keeps the ``keep_last`` newest committed steps and every step divisible by
  ``keep_every``; all others are deleted, index first (so the step stops being listed before
  any of its data goes), then its data files.
* Reference-aware: a data file is deleted only when no kept step's index references it.
  Incremental saves record references to files of older steps (``FileEntry.base``); those files
  stay in the old step's directory, which then has no index, until the last step referencing
  them is gone.
* Leftovers of crashed saves (files in a step directory without an index, and unreferenced files
  beside a committed index) are deleted once they cannot belong to a save in progress: the
  manager holds the root's lease, so the only saves in progress are its own, which it protects.
* Deleting requires the lease; it is verified right before each deletion.
* Cost: after a commit the coordinator lists only the new step's directory (the files its index
  references it knows from the save's write results); it lists the whole root at its first gc,
  after a failed save or gc, on an explicit :meth:`~CheckpointManager.gc` and every
  ``RESCAN_INTERVAL_S``.

Restore on another world size: tensors are resharded by DCP's load planner. State that differs
by rank (RNG, data loader position) is marked with :class:`~shardstore.stateful.PerRank` and
stored once per rank (``<name>.rank<r>``); the index records which entries are per rank, so a
restore under another world size fails clearly unless the wrapper says to drop the saved
values or take rank 0's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.checkpoint.storage import WriteResult

from shardstore.async_save import async_save as background_save
from shardstore.backends import Backend, open_backend
from shardstore.config import INDEX_NAME, WriteOptions
from shardstore.errors import CheckpointNotFoundError, ShardstoreError, StateMismatchError
from shardstore.index import Index, RankChunks, decode_index
from shardstore.lease import Lease
from shardstore.reader import ShardReader
from shardstore.stateful import PerRank
from shardstore.writer import ShardWriter

logger = logging.getLogger(__name__)

__all__ = ["CheckpointManager", "CheckpointInfo", "list_checkpoints", "step_name", "parse_step"]

STEP_PREFIX = "step-"
_STEP_RE = re.compile(r"^step-(\d{12})$")
_MAX_STEP = 10**12 - 1
#: Background gc lists the whole root at least this often (else only the steps it committed), so
#: files that a job which lost the lease wrote after the takeover are found too.
RESCAN_INTERVAL_S = 600.0
#: Key under which a :class:`PerRank` entry stores rank ``r``'s value: ``<name>.rank<r>.*``.
_RANK_KEY = "rank{}"


def step_name(step: int) -> str:
    """Directory name of ``step`` under the root (sortable: ``step-000000000100``)."""
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= _MAX_STEP:
        raise ValueError(f"step must be an int in [0, {_MAX_STEP}], got {step!r}")
    return f"{STEP_PREFIX}{step:012d}"


def parse_step(name: str) -> int | None:
    """The step of a directory name made by :func:`step_name`, else ``None``."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """One step directory under a manager root.

    Attributes:
        step: the training step.
        name: directory name (``step-000000000100``).
        url: path/URL of the step's checkpoint (give it to ``ShardReader``).
        committed: whether its index exists. Uncommitted directories are unfinished or crashed
            saves, or data kept only because a newer (incremental) step references it.
        nfiles: files in the directory (index included).
        created: commit time (seconds since the epoch) for committed steps.
        world_size: ranks that saved it.
        logical_nbytes: stored bytes of all its tensors, wherever they live.
        raw_nbytes: uncompressed bytes of all its tensors.
        added_nbytes: bytes of the data files this step wrote itself (the rest it references).
        bases: names of the older steps whose files it references.
        referenced_by: names of committed steps that read files in this directory (for an
            uncommitted one: it holds data that newer incremental steps still use).
    """

    step: int
    name: str
    url: str
    committed: bool
    nfiles: int
    created: float | None = None
    world_size: int | None = None
    logical_nbytes: int | None = None
    raw_nbytes: int | None = None
    added_nbytes: int | None = None
    bases: tuple[str, ...] = ()
    referenced_by: tuple[str, ...] = ()


@dataclasses.dataclass
class _Scan:
    """What is under a root: files per step directory (root-relative paths)."""

    files: dict[str, set[str]]

    @property
    def committed(self) -> list[int]:
        """Steps whose index exists, ascending."""
        steps = (parse_step(name) for name, paths in self.files.items() if f"{name}/{INDEX_NAME}" in paths)
        return sorted(s for s in steps if s is not None)


def _scan(backend: Backend) -> _Scan:
    files: dict[str, set[str]] = {}
    for path in backend.list():
        top, sep, _ = path.partition("/")
        if sep and parse_step(top) is not None:
            files.setdefault(top, set()).add(path)
    return _Scan(files=files)


def _read_index(backend: Backend, name: str) -> Index:
    path = f"{name}/{INDEX_NAME}"
    return decode_index(backend.read_small(path), source=f"{backend.url}/{path}")


def _references(name: str, index: Index) -> set[str]:
    """Root-relative paths of every data file ``index`` (of step dir ``name``) reads from."""
    return {f"{f.base or name}/{f.path}" for f in index.files}


def list_checkpoints(root: str | os.PathLike, storage_options: dict[str, Any] | None = None) -> list[CheckpointInfo]:
    """Every step directory under ``root``, ascending, committed or not (for ``shardstore ls``).

    Reads the index of each committed step for its sizes; takes no lease and changes nothing.
    """
    backend = open_backend(root, storage_options)
    try:
        scan = _scan(backend)
        committed = set(scan.committed)
        indexes: dict[str, Index] = {}
        for name in sorted(scan.files):
            if parse_step(name) in committed:
                try:
                    indexes[name] = _read_index(backend, name)
                except FileNotFoundError:  # retention of a live job deleted it since the listing
                    scan.files[name].discard(f"{name}/{INDEX_NAME}")
        users: dict[str, set[str]] = {}
        for name, index in indexes.items():
            for f in index.files:
                users.setdefault(f.base or name, set()).add(name)
        out = []
        for name in sorted(scan.files):
            step = parse_step(name)
            assert step is not None
            info = CheckpointInfo(
                step=step, name=name, url=backend.child(name).url, committed=name in indexes,
                nfiles=len(scan.files[name]), referenced_by=tuple(sorted(users.get(name, ()))),
            )
            index = indexes.get(name)
            if index is not None:
                info = dataclasses.replace(
                    info,
                    created=index.created,
                    world_size=index.world_size,
                    logical_nbytes=index.stored_nbytes(),
                    raw_nbytes=index.raw_nbytes(),
                    added_nbytes=sum(f.size for f in index.files if f.base is None),
                    bases=tuple(sorted({f.base for f in index.files if f.base is not None})),
                )
            out.append(info)
        return out
    finally:
        backend.close()


def retained_steps(committed: Iterable[int], *, keep_last: int | None, keep_every: int | None) -> set[int]:
    """The committed steps a retention policy keeps (all of them when ``keep_last`` is None)."""
    steps = sorted(committed)
    if keep_last is None:
        return set(steps)
    keep = set(steps[-keep_last:])
    if keep_every:
        keep |= {s for s in steps if s % keep_every == 0}
    return keep


class _ManagedWriter(ShardWriter):
    """A ShardWriter that verifies the manager's lease right before it commits (coordinator),
    and remembers which data files the committed index references (so gc need not read it)."""

    def __init__(self, path: Backend, *, name: str, lease: Lease | None, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self._name = name
        self._lease = lease
        self.references: set[str] | None = None

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        if self._lease is not None:
            self._lease.verify()
        super().finish(metadata, results)
        self.references = {  # the index's file table: every file a chunk names
            f"{base or self._name}/{path}"
            for rank_results in results
            for wr in rank_results
            if isinstance(wr.storage_data, RankChunks)
            for base, path in wr.storage_data.files
        }


@contextlib.contextmanager
def _quiet_single_process(single: bool) -> Iterator[None]:
    """Without a process group DCP warns that it assumes one process; that is intended here."""
    if not single:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


class CheckpointManager:
    """Save every N steps, keep the last few, restore the latest on any world size.

    Every rank constructs the manager and calls :meth:`save` / :meth:`restore` (they are
    collective, like ``dcp.save``/``dcp.load``). Rank 0 of ``process_group`` is the coordinator:
    it holds the root's lease and is the only rank that deletes. Without an initialised
    process group the manager works in a single process.

    Args:
        root: directory or URL holding one sub-directory per step (``/ckpt/run1``,
            ``s3://bucket/run1``, any fsspec URL).
        keep_last: keep this many newest committed steps (``None``: keep all).
        keep_every: with ``keep_last``, also keep every step divisible by this forever.
        async_save: :meth:`save` returns once the state is staged in memory; the write and
            commit continue in the background (``shardstore.async_save``).
        compression: ``None`` or ``"zstd"`` (see :class:`~shardstore.ShardWriter`).
        incremental: record references to unchanged chunks of the latest committed step
            instead of writing them again (``ShardWriter(incremental_base=...)``).
        storage_options: passed to fsspec / the S3 backend (endpoint, credentials).
        process_group: the group that saves and restores (default: the default group).
        lease_ttl: seconds after which a crashed job's lease on the root is taken over; a live
            second job saving to the same root is refused with ``LeaseHeldError``. ``None``
            disables the lease: the caller then guarantees a single writing job.
        writer_options: extra :class:`~shardstore.config.WriteOptions` fields (``threads``,
            ``frame_size``, ``level``, ``sync``...).
        reader_options: :class:`~shardstore.config.ReadOptions` fields for restores.

    Raises:
        ValueError: invalid options.

    Example:
        >>> with CheckpointManager("s3://bucket/run", keep_last=3) as mgr:
        ...     start = mgr.restore({"train": state}) or 0
        ...     for step in range(start + 1, steps + 1):
        ...         train_one_step()
        ...         if step % 100 == 0:
        ...             mgr.save(step, {"train": state})
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        keep_last: int | None = None,
        keep_every: int | None = None,
        async_save: bool = False,
        compression: str | None = None,
        incremental: bool = False,
        storage_options: dict[str, Any] | None = None,
        process_group: dist.ProcessGroup | None = None,
        lease_ttl: float | None = 60.0,
        writer_options: Mapping[str, Any] | None = None,
        reader_options: Mapping[str, Any] | None = None,
    ) -> None:
        for option, value in (("keep_last", keep_last), ("keep_every", keep_every)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{option} must be a positive int or None, got {value!r}")
        if keep_every is not None and keep_last is None:
            raise ValueError("keep_every only matters together with keep_last (without keep_last every step is kept)")
        if lease_ttl is not None and lease_ttl <= 0:
            raise ValueError(f"lease_ttl must be positive or None, got {lease_ttl!r}")
        self.writer_options = dict(writer_options or {})
        for reserved in ("overwrite", "compression", "incremental_base"):
            if reserved in self.writer_options:
                raise ValueError(f"writer_options may not set {reserved!r}: the manager controls it")
        WriteOptions(**{**self.writer_options, "compression": compression})  # validate now, not mid-training
        self.reader_options = dict(reader_options or {})
        self._async_save_fn: Callable[..., Any] | None = background_save if async_save else None

        self.root = os.fspath(root)
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.compression = compression
        self.incremental = incremental
        self.storage_options = storage_options
        self.process_group = process_group
        self.lease_ttl = lease_ttl
        self._backend = open_backend(self.root, storage_options)

        self._lock = threading.Lock()  # guards the save bookkeeping below
        self._gc_lock = threading.Lock()  # one gc at a time (background or explicit)
        self._seq = 0
        self._active: dict[int, tuple[str, str | None]] = {}  # seq -> (step dir, base dir) in flight
        self._started: dict[int, tuple[str, str | None]] = {}  # seq -> same, saves the last gc may not know
        self._index_cache: dict[str, set[str]] = {}  # committed step dir -> files it references
        # The coordinator's picture of the root, kept up to date from its own commits and
        # deletions (it holds the lease, so no one else writes there); rescanned after a failure.
        self._view: _Scan | None = None
        self._scanned_at = 0.0
        self._new_commits: list[tuple[str, set[str] | None]] = []  # (step dir, files it references)
        self._lease: Lease | None = None
        self._agreed = False  # first save's collective (lease + latest step) done
        self._latest: int | None = None  # newest committed step known to this job (all ranks)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="shardstore-manager")
        self._pending: Future | None = None  # async save waiter
        self._gc_future: Future | None = None
        self._gc_error: BaseException | None = None
        self._closed = False

    # -- ranks ----------------------------------------------------------------------------------

    @property
    def _distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    @property
    def rank(self) -> int:
        """Rank of this process in the manager's process group (0 without one)."""
        return dist.get_rank(self.process_group) if self._distributed else 0

    @property
    def world_size(self) -> int:
        """Size of the manager's process group (1 without one)."""
        return dist.get_world_size(self.process_group) if self._distributed else 1

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    def _broadcast(self, obj: Any) -> Any:
        """``obj`` as computed on the coordinator, on every rank."""
        if not self._distributed or self.world_size == 1:
            return obj
        buf = [obj]
        dist.broadcast_object_list(buf, group=self.process_group, group_src=0)
        return buf[0]

    def _coordinated(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the coordinator; every rank returns its result or raises its error."""
        if not self._distributed or self.world_size == 1:
            return fn()
        result: tuple[str, Any] = ("ok", None)
        error: BaseException | None = None
        if self.is_coordinator:
            try:
                result = ("ok", fn())
            except Exception as e:  # every rank must hear of it, or the others would hang
                error = e
                result = ("error", (type(e), str(e)))
        status, value = self._broadcast(result)
        if error is not None:
            raise error
        if status == "error":  # the coordinator's error, re-raised here with its type and message
            err_type, message = value
            try:
                exc = err_type(message)
            except TypeError:  # a type that takes other arguments
                exc = ShardstoreError(f"the coordinator rank failed: {err_type.__name__}: {message}")
            raise exc
        return value

    # -- listing --------------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Committed steps, ascending (a step is listed only once its index exists)."""
        return _scan(self._backend).committed

    def latest_step(self) -> int | None:
        """The newest committed step, or ``None`` when there is none."""
        steps = self.steps()
        return steps[-1] if steps else None

    def step_url(self, step: int) -> str:
        """Path/URL of ``step``'s checkpoint (to open it with ``ShardReader`` directly)."""
        return self._backend.child(step_name(step)).url

    # -- save -----------------------------------------------------------------------------------

    def save(self, step: int, state: Mapping[str, Any]) -> None:
        """Save ``state`` as ``step`` (collective: every rank calls it with the same keys).

        Args:
            step: the training step (an int in ``[0, 10**12)``); the checkpoint goes to
                ``<root>/step-<step:012d>``.
            state: names mapped to DCP ``Stateful`` objects (``TrainState``, a module, an
                optimizer...), (nested) state dicts of tensors / DTensors / ShardedTensors and
                plain values, or :class:`~shardstore.stateful.PerRank` wrappers.

        With ``async_save`` the call returns once the state is staged; an error of the
        background write is raised by the next :meth:`save`, :meth:`wait` or :meth:`close`.
        Retention runs after the commit, in the background, on the coordinator.

        Raises:
            LeaseHeldError: another job is saving to this root (first save only).
            CheckpointException: the save failed on some rank (DCP's error; nothing is
                committed and nothing is deleted). A save of an already committed step fails
                this way (``CheckpointExistsError`` inside), and so does the commit of a job
                that lost the root's lease to another (``LeaseLostError`` inside).
            Exception: with ``async_save``, the previous background save's error (this save
                then does not start).
        """
        self._check_open()
        name = step_name(step)
        self._collect_pending()
        self._agree_first_save()
        base = step_name(self._latest) if self.incremental and self._latest is not None else None
        sd, per_rank = self._save_state(state)
        writer = _ManagedWriter(
            self._backend.child(name),
            name=name,
            lease=self._lease if self.is_coordinator else None,
            storage_options=self.storage_options,
            user_metadata={"step": step, "per_rank": sorted(per_rank)},
            compression=self.compression,
            incremental_base=base,
            **self.writer_options,
        )
        seq = self._begin(name, base)
        t0 = time.perf_counter()
        try:
            with _quiet_single_process(not self._distributed):
                if self._async_save_fn is not None:
                    handle = self._async_save_fn(sd, storage_writer=writer, process_group=self.process_group)
                    self._pending = self._executor.submit(self._finish_async, seq, step, handle, writer, t0)
                    return
                dcp.save(sd, storage_writer=writer, process_group=self.process_group, no_dist=not self._distributed)
        except BaseException:
            self._end(seq, failed=True)
            raise
        self._committed(seq, step, writer, t0)
        if self.is_coordinator:
            self._schedule_gc()

    def _agree_first_save(self) -> None:
        """Take the lease (coordinator) and agree on the latest committed step, once."""
        if self._agreed:
            return

        def first() -> int | None:
            if self.lease_ttl is not None and self._lease is None:
                self._take_lease()
            return self.latest_step()

        latest = self._coordinated(first)
        self._latest = latest if self._latest is None else max(self._latest, latest or 0)
        self._agreed = True

    def _take_lease(self) -> None:
        lease = Lease(self._backend, ttl=self.lease_ttl or 60.0)
        lease.acquire()
        self._lease = lease

    def _save_state(self, state: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
        if not isinstance(state, Mapping):
            raise TypeError(f"state must map names to state, got {type(state).__name__}")
        sd: dict[str, Any] = {}
        per_rank = []
        for key, value in state.items():
            if not isinstance(key, str) or not key or "." in key:
                raise ValueError(f"state names must be non-empty strings without '.', got {key!r}")
            if isinstance(value, PerRank):
                sd[key] = {_RANK_KEY.format(self.rank): value.state_dict()}
                per_rank.append(key)
            elif isinstance(value, Stateful):
                sd[key] = value.state_dict()
            else:
                sd[key] = value
        return sd, per_rank

    def _begin(self, name: str, base: str | None) -> int:
        with self._lock:
            self._seq += 1
            self._active[self._seq] = self._started[self._seq] = (name, base)
            return self._seq

    def _end(self, seq: int, *, failed: bool = False) -> None:
        with self._lock:
            self._active.pop(seq, None)
            if failed:  # its ranks may have left files: the next gc rescans the root
                self._view = None

    def _committed(self, seq: int, step: int, writer: _ManagedWriter, t0: float) -> None:
        if self.is_coordinator:
            with self._lock:
                self._new_commits.append((step_name(step), writer.references))
        self._end(seq)
        self._latest = step if self._latest is None else max(self._latest, step)
        logger.info("step %d committed to %s in %.3f s", step, self.root, time.perf_counter() - t0)

    def _finish_async(self, seq: int, step: int, handle: Any, writer: _ManagedWriter, t0: float) -> None:
        try:
            handle.wait()
        except BaseException:
            self._end(seq, failed=True)
            raise
        self._committed(seq, step, writer, t0)
        if self.is_coordinator:
            self._schedule_gc()  # runs after this waiter, beside the next save

    def _collect_pending(self) -> None:
        """Wait for the previous async save; raise its error (once)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    # -- wait / close ---------------------------------------------------------------------------

    def wait(self) -> None:
        """Block until the pending async save and retention finish.

        Raises:
            Exception: the error of a failed background save, once.
        """
        try:
            self._collect_pending()
        finally:
            gc_future = self._gc_future
            if gc_future is not None:
                gc_future.result()  # _gc_background never raises; its error waits for close()

    def close(self) -> None:
        """Wait for pending work, release the lease, close the storage connections.

        Raises:
            Exception: a pending background save's error, or the first error of a background
                deletion (deletions are retried at every commit; they never lose data).
        """
        if self._closed:
            return
        self._closed = True
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)
            if self._lease is not None:
                self._lease.release()
                self._lease = None
            self._backend.close()
        error, self._gc_error = self._gc_error, None
        if error is not None:
            raise error

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except (Exception, CheckpointException):  # the exception already propagating is the one to report
            logger.exception("closing the checkpoint manager of %s after an error also failed", self.root)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"the checkpoint manager of {self.root} is closed")

    # -- restore --------------------------------------------------------------------------------

    def restore(self, state: Mapping[str, Any] | dict[str, Any], step: int | None = None) -> int | None:
        """Load a committed step into ``state`` (collective), on any world size.

        Tensors are resharded by DCP to the layout of the targets in ``state``. ``Stateful``
        objects are restored in place; plain entries of a ``dict`` ``state`` are replaced.

        Args:
            state: like in :meth:`save`; its entries are the targets.
            step: the step to load; ``None`` for the latest committed one.

        Returns:
            The step restored, or ``None`` when ``step`` is None and nothing is committed
            (``state`` is left as it is).

        Raises:
            CheckpointNotFoundError: ``step`` is not a committed step.
            StateMismatchError: a :class:`PerRank` entry cannot follow a world-size change
                (``on_resize="error"``), or ``state`` and the checkpoint disagree on which
                entries are per rank.
        """
        self._check_open()
        self.wait()

        def choose() -> int | None:
            steps = self.steps()
            if step is None:
                return steps[-1] if steps else None
            step_name(step)
            if step not in steps:
                raise CheckpointNotFoundError(
                    f"step {step} is not a committed checkpoint under {self.root}; committed steps: {_short(steps)}"
                )
            return step

        chosen = self._coordinated(choose)
        if chosen is None:
            return None
        t0 = time.perf_counter()
        reader = ShardReader(
            self._backend.child(step_name(chosen)), storage_options=self.storage_options, **self.reader_options
        )
        sd, after = self._restore_state(state, reader.index, chosen)
        with _quiet_single_process(not self._distributed):
            dcp.load(sd, storage_reader=reader, process_group=self.process_group, no_dist=not self._distributed)
        for key, fn in after:
            fn(sd[key])
        if isinstance(state, dict):
            for key, value in sd.items():
                if key in state and not isinstance(state[key], (PerRank, Stateful)):
                    state[key] = value
        logger.info("restored step %d from %s in %.3f s", chosen, self.root, time.perf_counter() - t0)
        return chosen

    def _restore_state(
        self, state: Mapping[str, Any], index: Index, step: int
    ) -> tuple[dict[str, Any], list[tuple[str, Callable[[Any], None]]]]:
        """The state dict DCP loads into, and what to apply per ``PerRank`` entry afterwards."""
        per_rank_saved = set(index.user.get("per_rank") or ())
        saved_ws, ws = index.world_size, self.world_size
        sd: dict[str, Any] = {}
        after: list[tuple[str, Callable[[Any], None]]] = []
        for key, value in state.items():
            if not isinstance(value, PerRank):
                if key in per_rank_saved:
                    raise StateMismatchError(
                        f"{key!r} was saved per rank in step {step} under {self.root}; "
                        "wrap its target in PerRank to restore it"
                    )
                sd[key] = value
                continue
            if key not in per_rank_saved:
                raise StateMismatchError(
                    f"{key!r} is PerRank in the state to restore, but step {step} under {self.root} saved it "
                    "as one value for all ranks (or not at all)"
                )
            if ws == saved_ws:
                src = self.rank
            elif value.on_resize == "rank0":
                src = 0
            elif value.on_resize == "drop":
                logger.info(
                    "step %d was saved on %d ranks, restoring on %d: keeping the live value of per-rank %r",
                    step, saved_ws, ws, key,
                )
                continue
            else:
                raise StateMismatchError(
                    f"per-rank state {key!r} of step {step} under {self.root} was saved on {saved_ws} ranks and "
                    f"cannot follow a restore on {ws} ranks; mark it PerRank(..., on_resize='drop') to keep the "
                    "live value or on_resize='rank0' to take rank 0's value"
                )
            rank_key = _RANK_KEY.format(src)
            sd[key] = {rank_key: value.state_dict()}
            after.append((key, lambda loaded, v=value, k=rank_key: v.load_state_dict(loaded[k])))
        return sd, after

    # -- retention and gc -----------------------------------------------------------------------

    def gc(self, *, dry_run: bool = False) -> list[str]:
        """Delete (or with ``dry_run`` only list) what retention and crashed saves left behind.

        Runs on the coordinator; on other ranks it returns ``[]`` and touches nothing. Deleting
        takes the root's lease first (refused with ``LeaseHeldError`` while another job holds
        it). ``dry_run`` takes no lease and deletes nothing; an unfinished step newer than the
        latest committed one is then assumed to be a save in progress and is not listed.

        Returns:
            Root-relative paths deleted (or that would be): for each step removed, its index
            first, then data files no kept step references.
        """
        self._check_open()
        if not self.is_coordinator:
            return []
        if not dry_run and self.lease_ttl is not None:
            if self._lease is None:
                self._take_lease()
            self._lease.verify()
        with self._gc_lock:
            return self._collect_garbage(dry_run=dry_run, rescan=True)

    def _schedule_gc(self) -> None:
        queued = self._gc_future
        if queued is not None and not queued.running() and not queued.done():
            return  # the queued run will see this commit too
        self._gc_future = self._executor.submit(self._gc_background)

    def _gc_background(self) -> None:
        try:
            with self._gc_lock:
                self._collect_garbage(dry_run=False, rescan=False)
        except Exception as e:  # deletion is retried at the next commit; report it at close()
            logger.exception("retention/gc under %s failed (retried after the next commit)", self.root)
            with self._lock:
                self._view = None
            if self._gc_error is None:
                self._gc_error = e

    def _current_view(self, *, rescan: bool, owner: bool) -> _Scan:
        """The files under the root: all listed, or (owner, nothing failed since) the view kept
        up to date by listing only the steps committed since the last gc."""
        with self._lock:
            new, self._new_commits = self._new_commits, []
            view = self._view
        for name, refs in new:
            if refs is not None:
                self._index_cache[name] = refs
        if rescan or view is None or not owner or time.monotonic() - self._scanned_at > RESCAN_INTERVAL_S:
            view = _scan(self._backend)
            self._scanned_at = time.monotonic()
        else:  # add what the commits since the last gc wrote: one listing of each new step
            for name, _ in new:
                view.files.setdefault(name, set()).update(self._backend.list(name))
        if owner:
            with self._lock:
                self._view = view
        return view

    def _collect_garbage(self, *, dry_run: bool, rescan: bool) -> list[str]:
        owner = self._lease is not None or self.lease_ttl is None
        with self._lock:
            seq0 = self._seq
            active = list(self._active.values())
        view = self._current_view(rescan=rescan, owner=owner)
        with self._lock:  # saves started after the listing began may appear half-written in it
            later = [v for s, v in self._started.items() if s > seq0]
            self._started = {s: v for s, v in self._started.items() if s > seq0 or s in self._active}
        protected = {name for name, _ in active + later}
        bases = {parse_step(b) for _, b in active + later if b is not None}
        committed = view.committed
        if not owner:  # another job may be saving: its unfinished step is newer than all committed
            newest = committed[-1] if committed else -1
            protected |= {n for n in view.files if (parse_step(n) or 0) > newest}
        keep = retained_steps(committed, keep_last=self.keep_last, keep_every=self.keep_every)
        keep |= {b for b in bases if b in committed}
        if committed:
            keep.add(committed[-1])
        referenced: set[str] = set()
        for s in keep:
            referenced |= self._referenced(step_name(s))
        self._index_cache = {n: r for n, r in self._index_cache.items() if parse_step(n) in keep}
        indexes, data = [], []
        for name, paths in sorted(view.files.items()):
            if name in protected:
                continue
            index_path = f"{name}/{INDEX_NAME}"
            if index_path in paths and parse_step(name) not in keep:
                indexes.append(index_path)
            data += sorted(p for p in paths if p != index_path and p not in referenced)
        if dry_run or not (indexes or data):
            return indexes + data
        if self._lease is not None:
            self._lease.verify()
        self._backend.delete(indexes)  # uncommit first: a step is never listed with data missing
        self._backend.delete(data)
        for path in indexes + data:
            name = path.partition("/")[0]
            view.files[name].discard(path)
            if not view.files[name]:
                del view.files[name]
        logger.info(
            "gc of %s: removed %d steps (%s) and %d data files",
            self.root, len(indexes), ", ".join(str(parse_step(p.split("/")[0])) for p in indexes) or "-", len(data),
        )
        return indexes + data

    def _referenced(self, name: str) -> set[str]:
        refs = self._index_cache.get(name)
        if refs is None:
            refs = self._index_cache[name] = _references(name, _read_index(self._backend, name))
        return refs


def _short(steps: list[int]) -> str:
    if not steps:
        return "none"
    return ", ".join(map(str, steps)) if len(steps) <= 8 else f"{steps[0]}, ..., {steps[-1]} ({len(steps)} steps)"

