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
span of the chunk that holds it and to the frames covering that span. The frames of one file are
sorted and cut into runs of at most ``max_range`` bytes, or the store's ``read_size`` where that
is larger (adjacent frames, and the few padding bytes between records, are read together); several threads read the runs, the files of a rank
taking turns so that each file is read front to back by about one thread at a time. A load opens
each data file once and shares it between its threads, so the kernel's readahead follows it.

Where the bytes land: a load's cost is its passes over memory, so each read puts a frame where
it will stay. When the read item's sub-box is one contiguous span of the chunk and the target is
a contiguous CPU tensor of the stored dtype (dim-0 sharding, FSDP's case, also when resharding),
every raw frame that lies wholly inside the span is read straight into the target's memory (one
scatter read per run, ``preadv`` on POSIX) and its checksum is verified there. Frames that are
compressed, only partly inside the span (the ends of a resharded span), or shared by two read
items are read into a small scratch buffer, verified, decoded, and the needed part copied into
place. Any other target (another dtype, non-contiguous, off the CPU, or a sub-box that is not one
span) gets a staging buffer for the span, filled the same way and then copied into the target
with ``copy_`` (which casts). Backends that cannot read into caller memory (fsspec, S3) read and
copy once inside their :class:`~shardstore.backends.base.FileReader`. A checksum mismatch raises,
so a failed load may leave a target partly overwritten, never silently wrong.

The index is read and validated when the reader is constructed, so a missing or malformed
checkpoint fails at ``ShardReader(path)`` with a clear error rather than inside DCP.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future
from torch.distributed.checkpoint.storage import StorageReader

from shardstore.backends import Backend, open_backend, sibling_url
from shardstore.backends.base import FileReader
from shardstore.codec import HASH_SIZE, Codec, decode_frame, frame_hash
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

#: Frames of one file closer than this are read together (records are padded to 64-byte
#: boundaries; the padding is read into scratch and dropped).
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


@dataclass(eq=False)
class _Need:
    """One ReadItem mapped to stored bytes: frames ``g0:g1`` of chunk ``chunk`` of tensor ``fqn``.

    ``target``, ``dest`` and ``in_place`` are set when the first read touching the need runs;
    ``pending`` counts its frames not yet landed in ``dest``.
    """

    item: ReadItem
    fqn: str
    tensor: TensorEntry
    chunk: int
    span: tuple[int, int]  # byte span [a, b) inside the chunk's raw bytes
    g0: int  # first frame (tensor-global frame id)
    g1: int
    target: torch.Tensor | None = None
    dest: memoryview | None = None  # bytes of the span: the target's own memory, or a staging buffer
    in_place: bool = False
    pending: int = 0


@dataclass(eq=False)
class _Frame:
    """One stored frame to read and the needs that use (part of) its raw bytes."""

    fqn: str
    raw_start: int  # offset of its raw bytes in the chunk's raw bytes
    raw_len: int
    pos: int  # stored bytes [pos, pos + length) in the data file
    length: int
    codec: int
    digest: bytes
    users: list[_Need] = field(default_factory=list)

    def direct(self) -> _Need | None:
        """The need whose ``dest`` this frame's stored bytes can be read into as they are."""
        if len(self.users) != 1 or self.codec != Codec.RAW or self.length != self.raw_len:
            return None
        n = self.users[0]
        a, b = n.span
        return n if a <= self.raw_start and self.raw_start + self.raw_len <= b else None


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

        # Runs of different files take turns, so that each file tends to be read by one thread
        # at a time, front to back: the kernel's readahead follows one sequential reader per
        # file, not several interleaved ones.
        per_file = [
            [(fid, run) for run in self._runs(self._frames(file_needs), self._run_limit(fid))]
            for fid, file_needs in needs.items()
        ]
        tasks = [task for turn in itertools.zip_longest(*per_file) for task in turn if task is not None]
        lock = threading.Lock()
        files: dict[int, FileReader] = {}  # opened by the first run that reads the file
        errors: list[BaseException] = []
        try:
            if len(tasks) <= 1 or self.options.threads == 1:
                for fid, run in tasks:
                    self._read_run(fid, run, planner, lock, files)
            else:
                with ThreadPoolExecutor(min(self.options.threads, len(tasks)), "shardstore-read") as pool:
                    futures = [pool.submit(self._read_run, fid, run, planner, lock, files) for fid, run in tasks]
                    for f in futures:
                        try:
                            f.result()
                        except Exception as e:  # let every read finish, then raise the first failure
                            errors.append(e)
        finally:
            for reader in files.values():
                reader.close()
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
        itemsize = t.dtype.itemsize
        a, b = first * itemsize, (last + 1) * itemsize
        fs = self.index.frame_size
        base = int(t.frame_start[c])
        g0, g1 = base + a // fs, base + (b - 1) // fs + 1
        return _Need(item, fqn, t, c, (a, b), g0, g1)

    def _frames(self, needs: list[_Need]) -> list[_Frame]:
        """The frames ``needs`` (of one file) use, each once, sorted by file position."""
        fs = self.index.frame_size
        frames: dict[tuple[str, int], _Frame] = {}
        for n in needs:
            t, g0, g1 = n.tensor, n.g0, n.g1
            base = int(t.frame_start[n.chunk])
            record_raw = t.raw_nbytes(n.chunk)
            # One numpy -> list conversion per need: per-frame numpy scalar indexing is slow.
            pos = t.frame_pos[g0:g1].tolist()
            lens = t.frame_len[g0:g1].tolist()
            codecs = t.frame_codec[g0:g1].tolist()
            digests = t.frame_hash[g0:g1].tobytes()
            n.pending = g1 - g0
            for i in range(g1 - g0):
                f = frames.get((n.fqn, g0 + i))
                if f is None:
                    raw_start = (g0 + i - base) * fs
                    f = frames[(n.fqn, g0 + i)] = _Frame(
                        n.fqn, raw_start, min(fs, record_raw - raw_start), pos[i], lens[i], codecs[i],
                        digests[HASH_SIZE * i : HASH_SIZE * (i + 1)],
                    )
                f.users.append(n)
        return sorted(frames.values(), key=lambda f: f.pos)

    def _run_limit(self, file_id: int) -> int:
        """Bytes per read of a data file: ``max_range``, or more where its store wants it."""
        backend, _ = self.open_file(self.index.files[file_id])
        return max(self.options.max_range, backend.read_size or 0)

    def _runs(self, frames: list[_Frame], limit: int) -> list[list[_Frame]]:
        """Cut sorted frames into reads: adjacent frames (up to ``MERGE_GAP`` apart) together,
        at most ``limit`` bytes each (one frame larger than that is read alone)."""
        runs: list[list[_Frame]] = []
        start = end = -1
        for f in frames:
            if runs and f.pos <= end + MERGE_GAP and f.pos + f.length - start <= limit:
                runs[-1].append(f)
            else:
                runs.append([f])
                start = f.pos
            end = f.pos + f.length
        return runs

    # -- reading one run of frames --------------------------------------------------------

    def open_file(self, entry: FileEntry) -> tuple[Backend, str]:
        """The backend and path holding a data file, following incremental references."""
        if entry.base is None:
            return self.backend, entry.path
        backend = self._siblings.get(entry.base)
        if backend is None:
            backend = self._siblings[entry.base] = open_backend(sibling_url(self.path, entry.base), self.storage_options)
        return backend, entry.path

    def _resolve(self, need: _Need, planner: LoadPlanner) -> None:
        """Resolve the need's target and choose where its span's bytes land (under the lock)."""
        target = planner.resolve_tensor(need.item).detach()
        if tuple(target.shape) != tuple(need.item.lengths):
            raise StateMismatchError(
                f"{need.fqn!r}: target has shape {tuple(target.shape)}, read item has {tuple(need.item.lengths)}"
            )
        need.target = target
        a, b = need.span
        mem = _target_bytes(target, need.tensor.dtype, b - a)
        need.in_place = mem is not None
        need.dest = mem if mem is not None else memoryview(np.empty(b - a, dtype=np.uint8))

    def _read_run(
        self, file_id: int, frames: list[_Frame], planner: LoadPlanner, lock: threading.Lock,
        files: dict[int, FileReader],
    ) -> None:
        """Read one run of frames of a data file, verify them, put them in place, commit the
        read items whose last frame this was."""
        entry = self.index.files[file_id]
        shown = entry.path if entry.base is None else f"../{entry.base}/{entry.path}"  # for messages
        with lock:
            for f in frames:
                for n in f.users:
                    if n.target is None:
                        self._resolve(n, planner)
            file = files.get(file_id)
            if file is None:
                backend, path = self.open_file(entry)
                try:
                    file = files[file_id] = backend.open_reader(path)
                except FileNotFoundError:
                    raise CorruptCheckpointError(
                        f"data file {shown} of checkpoint {self.backend.url} is missing (needed for {frames[0].fqn!r})"
                    ) from None

        direct = [f.direct() for f in frames]
        buffers, landed = _layout(frames, direct)
        start, end = frames[0].pos, frames[-1].pos + frames[-1].length
        try:
            file.read_into(start, buffers)
        except FileNotFoundError:
            raise CorruptCheckpointError(
                f"data file {shown} of checkpoint {self.backend.url} is missing (needed for {frames[0].fqn!r})"
            ) from None
        except TruncatedFileError as e:
            raise TruncatedFileError(
                f"data file {shown} of checkpoint {self.backend.url} is truncated (needed for {frames[0].fqn!r}): {e}"
            ) from None
        with lock:
            self.bytes_read += end - start

        for f, d, stored in zip(frames, direct, landed):
            self._verify(f, stored if d is not None else self._decode(f, stored, shown), shown, scatter=d is None)

        done = []
        with lock:
            for f in frames:
                for n in f.users:
                    n.pending -= 1
                    if n.pending == 0:
                        done.append(n)
        for n in done:
            assert n.target is not None and n.dest is not None
            if not n.in_place:
                n.target.copy_(_staged(n))  # casts to the target's dtype, device and layout
            n.dest = None  # drop the staging buffer
            with lock:
                planner.commit_tensor(n.item, n.target)

    def _decode(self, f: _Frame, stored: memoryview, path: str) -> memoryview | bytes:
        try:
            return decode_frame(stored, f.codec, f.raw_len)
        except CorruptCheckpointError as e:
            raise CorruptCheckpointError(
                f"checkpoint {self.backend.url}, file {path}, tensor {f.fqn!r}, bytes [{f.pos}, {f.pos + f.length}): "
                f"{e} (checksum cannot be verified)"
            ) from None

    def _verify(self, f: _Frame, raw: memoryview | bytes, path: str, *, scatter: bool) -> None:
        """Check a frame's raw bytes against its checksum; with ``scatter``, copy the part each
        user needs into its ``dest`` (the frame was read into scratch)."""
        if self.options.verify and frame_hash(raw) != f.digest:
            raise CorruptCheckpointError(
                f"checksum mismatch in checkpoint {self.backend.url}, file {path}, tensor {f.fqn!r}, "
                f"bytes [{f.pos}, {f.pos + f.length})"
            )
        if scatter:
            raw = memoryview(raw).cast("B")
            for n in f.users:
                assert n.dest is not None
                a, b = n.span
                lo, hi = max(a, f.raw_start), min(b, f.raw_start + f.raw_len)
                n.dest[lo - a : hi - a] = raw[lo - f.raw_start : hi - f.raw_start]


def _layout(frames: list[_Frame], direct: list[_Need | None]) -> tuple[list[memoryview], list[memoryview]]:
    """Where a run's bytes go: the buffers of its scatter read, and each frame's stored bytes.

    A frame whose ``direct`` need is set lands in that need's ``dest`` (the target's memory or
    its staging buffer) at the frame's place in the span; the others, and the padding between
    records, land in one scratch buffer. Adjacent pieces of one buffer make one read buffer.
    """
    start, end = frames[0].pos, frames[-1].pos + frames[-1].length
    scratch_len = (end - start) - sum(f.length for f, d in zip(frames, direct) if d is not None)
    scratch = memoryview(np.empty(scratch_len, dtype=np.uint8))
    pieces: list[list[Any]] = []  # [buffer, lo, hi]
    landed: list[memoryview] = []
    s, cursor = 0, start

    def put(buf: memoryview, lo: int, hi: int) -> None:
        if pieces and pieces[-1][0] is buf and pieces[-1][2] == lo:
            pieces[-1][2] = hi
        else:
            pieces.append([buf, lo, hi])

    for f, d in zip(frames, direct):
        if f.pos > cursor:  # padding between records
            put(scratch, s, s + f.pos - cursor)
            s += f.pos - cursor
        if d is not None:
            assert d.dest is not None
            lo = f.raw_start - d.span[0]
            put(d.dest, lo, lo + f.length)
            landed.append(d.dest[lo : lo + f.length])
        else:
            put(scratch, s, s + f.length)
            landed.append(scratch[s : s + f.length])
            s += f.length
        cursor = f.pos + f.length
    return [buf[lo:hi] for buf, lo, hi in pieces], landed


def _target_bytes(target: torch.Tensor, dtype: torch.dtype, nbytes: int) -> memoryview | None:
    """The target's memory as writable bytes, if the span's stored bytes are its bytes as they are.

    That needs a plain contiguous CPU tensor of the stored dtype whose size is the span's (a
    sub-box that is not one contiguous span of the chunk covers more bytes than it holds).
    """
    if (
        type(target) is not torch.Tensor
        or target.dtype != dtype
        or target.device.type != "cpu"
        or target.layout != torch.strided
        or not target.is_contiguous()
        or target.is_conj()
        or target.is_neg()
        or target.numel() * target.element_size() != nbytes
    ):
        return None
    return memoryview(target.reshape(-1).view(torch.uint8).numpy())


def _staged(need: _Need) -> torch.Tensor:
    """A tensor view of the read item's sub-box inside the need's staging buffer."""
    assert need.dest is not None
    t = need.tensor
    a, _ = need.span
    sizes = t.sizes[need.chunk].tolist()
    strides = _row_major_strides(sizes)
    first = sum(o * s for o, s in zip(need.item.storage_offsets, strides))
    flat = torch.frombuffer(need.dest, dtype=t.dtype)
    return flat.as_strided(list(need.item.lengths), strides, first - a // t.dtype.itemsize)


def _row_major_strides(sizes: list[int]) -> list[int]:
    strides = [1] * len(sizes)
    for d in range(len(sizes) - 2, -1, -1):
        strides[d] = strides[d + 1] * sizes[d + 1]
    return strides
