"""ShardWriter: DCP ``StorageWriter`` that writes each rank's shards in parallel, index last.

DCP calls a storage writer in this order (``torch.distributed.checkpoint.save``)::

    reset(checkpoint_id)                      all ranks, when a checkpoint_id is given
    set_up_storage_writer(is_coordinator)     all ranks
    prepare_local_plan(plan)                  all ranks
    prepare_global_plan(plans)                coordinator: names each rank's data files
    write_data(plan, planner)                 all ranks: resolve -> bytes -> frames -> files
    finish(metadata, results)                 coordinator: build the index, publish it (commit)

Each rank writes ``threads`` data files at once, one thread per file, items balanced by size.
Data files are named after a per-save id, so a save into a path that already holds a checkpoint
never touches the files the old index points at; the old index stays valid until the new one
replaces it in one atomic publish (``overwrite=True``), or the save is refused up front.
A rank that fails aborts its open files; DCP then fails the save on every rank and ``finish``
never runs, so no index is published.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.futures import Future
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult

from shardstore.backends import Backend, open_backend, sibling_url
from shardstore.backends.posix import PosixBackend
from shardstore.codec import Codec, choose_codec, encode_frame, frame_hash
from shardstore.config import INDEX_NAME, WriteOptions
from shardstore.errors import CheckpointExistsError, InvalidCheckpointError, UnsupportedValueError
from shardstore.index import FileEntry, Index, RankChunks, StoredChunk, StoredValue, build_index, encode_index
from shardstore.staging import AsyncStagerMixin
from shardstore.values import check_index_value, value_from_dcp_bytes

logger = logging.getLogger(__name__)

#: Records start at multiples of this many bytes, so raw frames can be viewed in place.
RECORD_ALIGN = 64

#: ``MetadataIndex.fqn`` of the write result that carries a rank's packed chunks (DCP does not
#: look at write results; only ``finish`` does).
RANK_CHUNKS_FQN = "<shardstore rank chunks>"


@dataclasses.dataclass(frozen=True)
class _RankFiles:
    """``SavePlan.storage_data`` set by the coordinator: the prefix of a rank's file names."""

    prefix: str


def _balance(items: list[WriteItem], nbuckets: int) -> list[list[WriteItem]]:
    """Split items into ``nbuckets`` lists of similar byte size (largest first, greedy)."""

    def nbytes(item: WriteItem) -> int:
        td = item.tensor_data
        if td is None:
            return 0
        return int(np.prod(td.chunk.sizes)) * torch.empty((), dtype=td.properties.dtype).element_size()

    buckets: list[list[WriteItem]] = [[] for _ in range(nbuckets)]
    load = [0] * nbuckets
    for item in sorted(items, key=nbytes, reverse=True):
        i = load.index(min(load))
        buckets[i].append(item)
        load[i] += nbytes(item)
    return [b for b in buckets if b]


def _resolve_value(planner: SavePlanner, item: WriteItem):
    """The planner's ``torch.save`` bytes of a non-tensor value, with the key named on failure."""
    try:
        return planner.resolve_data(item)
    except (TypeError, AttributeError, RuntimeError, ValueError) as e:  # pickling failed in torch.save
        raise UnsupportedValueError(f"cannot store the value of {item.index.fqn!r} without pickle: {e}") from e


def tensor_bytes(tensor: torch.Tensor) -> tuple[torch.Tensor, memoryview]:
    """Contiguous CPU copy (if needed) of ``tensor`` and a byte view of it.

    Returns the tensor too: the memoryview borrows its memory, so the caller keeps it alive.
    """
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.contiguous()
    if t.numel() == 0:
        return t, memoryview(b"")
    return t, memoryview(t.reshape(-1).view(torch.uint8).numpy())


class ShardWriter(StorageWriter, AsyncStagerMixin):
    """Write a distributed checkpoint to a local path, NFS, S3 or any fsspec URL.

    Args:
        path: checkpoint directory or URL (``/data/ckpt``, ``file://...``, ``s3://b/run/step-100``,
            ``memory://...``).
        storage_options: passed to fsspec (e.g. ``{"endpoint_url": ...}`` for S3).
        user_metadata: plain data (str-keyed dicts, lists, str, numbers, bytes, None) stored in
            the index, e.g. the training step; ``shardstore inspect`` shows it.
        **options: fields of :class:`shardstore.config.WriteOptions` (``threads``,
            ``frame_size``, ``compression``, ``level``, ``overwrite``, ``sync``...).

    Raises:
        UnsupportedValueError: ``user_metadata`` holds something the index cannot store (it
            names the key), so the save never commits an index that no reader accepts.

    Example:
        >>> dcp.save(state_dict, storage_writer=ShardWriter("/ckpt/step-100"))

    It is also DCP's ``AsyncStager``: ``dcp.async_save(sd, storage_writer=ShardWriter(p))``
    stages into reused host buffers (:mod:`shardstore.staging`).
    """

    def __init__(
        self,
        path: str | os.PathLike | Backend,
        *,
        storage_options: dict[str, Any] | None = None,
        user_metadata: dict[str, Any] | None = None,
        **options: Any,
    ) -> None:
        super().__init__()
        self.options = WriteOptions(**options)
        self.storage_options = storage_options
        self.user_metadata = dict(user_metadata or {})
        check_index_value(self.user_metadata, "user_metadata")
        self._backend: Backend | None = path if isinstance(path, Backend) else None
        self.path = path.url if isinstance(path, Backend) else os.fspath(path)
        self.is_coordinator = False
        self.rank = 0
        self._save_id = ""
        self.bytes_written = 0
        self._t0 = 0.0
        self._base: Index | None = None

    # -- DCP protocol ---------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
            self._backend = None
        self._save_id = ""
        self.bytes_written = 0

    @property
    def backend(self) -> Backend:
        if self._backend is None:
            self._backend = open_backend(self.path, self.storage_options)
        if isinstance(self._backend, PosixBackend):
            self._backend.sync = self.options.sync
        return self._backend

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank", 0) or 0)
        if not kwargs.get("rank") and torch.distributed.is_available() and torch.distributed.is_initialized():
            self.rank = torch.distributed.get_rank()
        self._t0 = time.perf_counter()
        if is_coordinator and not self.options.overwrite and self.backend.exists(INDEX_NAME):
            raise CheckpointExistsError(
                f"{self.backend.url} already holds a committed checkpoint; "
                "pass overwrite=True to replace it atomically, or save to a new path"
            )
        self._base = None
        if self.options.incremental_base is not None:
            from shardstore.reader import load_index

            base = load_index(open_backend(sibling_url(self.path, self.options.incremental_base), self.storage_options))
            if base.frame_size == self.options.frame_size:
                self._base = base
            else:
                logger.warning(
                    "incremental base %s has frame_size %d, this save %d: writing every chunk",
                    self.options.incremental_base, base.frame_size, self.options.frame_size,
                )

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        save_id = uuid.uuid4().hex[:12]
        return [
            dataclasses.replace(plan, storage_data=_RankFiles(prefix=f"data-{save_id}-r{rank:05d}"))
            for rank, plan in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's items; return one ``WriteResult`` per non-tensor value and one for all
        tensor chunks together (``storage_data`` a :class:`~shardstore.index.RankChunks`), so that
        DCP's gather of write results moves a few byte strings per rank, not an object per chunk."""
        prefix = plan.storage_data.prefix
        results: list[WriteResult] = []
        chunks: list[tuple[MetadataIndex, StoredChunk]] = []
        tensors = []
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                data = value_from_dcp_bytes(_resolve_value(planner, item), item.index.fqn)
                results.append(WriteResult(index=item.index, size_in_bytes=len(data), storage_data=StoredValue(data)))
            else:
                tensors.append(item)
        buckets = _balance(tensors, self.options.threads)
        backend = self.backend
        encode_pool = ThreadPoolExecutor(self.options.threads, "shardstore-encode") if self.options.compression else None
        try:
            with ThreadPoolExecutor(max(1, len(buckets)), "shardstore-write") as file_pool:
                files = [
                    file_pool.submit(self._write_file, backend, f"{prefix}-{i:02d}.bin", items, planner, encode_pool)
                    for i, items in enumerate(buckets)
                ]
                errors = []
                for f in files:
                    try:
                        chunks.extend(f.result())
                    except Exception as e:  # wait for every file, then raise the first failure
                        errors.append(e)
                if errors:
                    raise errors[0]
        finally:
            if encode_pool is not None:
                encode_pool.shutdown()
        written = sum(int(np.frombuffer(c.lens, dtype="<i8").sum()) for _, c in chunks if c.base is None)
        results.append(
            WriteResult(index=MetadataIndex(fqn=RANK_CHUNKS_FQN, index=self.rank), size_in_bytes=written,
                        storage_data=RankChunks.pack(chunks))
        )
        self.bytes_written = sum(r.size_in_bytes for r in results)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        index = build_index(
            metadata, results, frame_size=self.options.frame_size, files=self._base_files(), user=self.user_metadata
        )
        data = encode_index(index)
        backend = self.backend
        backend.publish(INDEX_NAME, data, overwrite=self.options.overwrite)
        if self.options.overwrite:  # drop data files of the checkpoint this one replaced
            keep = {f.path for f in index.files if f.base is None} | {INDEX_NAME}
            stale = [p for p in backend.list() if p not in keep and p.startswith("data-")]
            backend.delete(stale)
        seconds = time.perf_counter() - self._t0
        stored = index.stored_nbytes()
        logger.info(
            "saved %s: %d tensors, %.1f MB stored (%.1f MB raw), %.2f s, %.2f GB/s",
            backend.url, len(index.tensors), stored / 1e6, index.raw_nbytes() / 1e6, seconds,
            stored / max(seconds, 1e-9) / 1e9,
        )

    def _base_files(self) -> dict[tuple[str | None, str], FileEntry]:
        """File entries of the incremental base, as references from this checkpoint."""
        if self._base is None:
            return {}
        out = {}
        for f in self._base.files:
            holder = f.base or self.options.incremental_base
            out[(holder, f.path)] = FileEntry(path=f.path, size=f.size, base=holder)
        return out

    def _reuse(self, item: WriteItem, tensor: torch.Tensor, digests: list[bytes]) -> StoredChunk | None:
        """The base's record of this chunk if its frames' digests are unchanged, else None."""
        t = self._base.tensors.get(item.index.fqn) if self._base is not None else None
        if t is None or t.dtype != tensor.dtype or t.shape != tuple(item.tensor_data.size):
            return None
        try:
            c = t.chunk_id(item.index.offset or ())
        except InvalidCheckpointError:
            return None
        lo, hi = int(t.frame_start[c]), int(t.frame_start[c + 1])
        if tuple(t.sizes[c].tolist()) != tuple(item.tensor_data.chunk.sizes) or hi - lo != len(digests):
            return None
        hashes = t.frame_hash[lo:hi].tobytes()
        if b"".join(digests) != hashes:
            return None
        entry = self._base.files[int(t.file[c])]
        return StoredChunk(
            file=entry.path,
            base=entry.base or self.options.incremental_base,
            pos=int(t.pos[c]),
            sizes=tuple(item.tensor_data.chunk.sizes),
            lens=t.frame_len[lo:hi].astype("<i8").tobytes(),
            codecs=t.frame_codec[lo:hi].tobytes(),
            hashes=hashes,
        )

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True

    # -- one data file --------------------------------------------------------------------

    def _write_file(
        self,
        backend: Backend,
        path: str,
        items: list[WriteItem],
        planner: SavePlanner,
        encode_pool: ThreadPoolExecutor | None,
    ) -> list[tuple[MetadataIndex, StoredChunk]]:
        opts = self.options
        results: list[tuple[MetadataIndex, StoredChunk]] = []
        pos = 0
        out = None  # opened at the first chunk that is really written (incremental saves skip some)
        try:
            for item in items:
                tensor, raw = tensor_bytes(planner.resolve_data(item))
                codec = choose_codec(opts.compression, tensor.is_floating_point(), tensor.element_size())
                frames = [raw[i : i + opts.frame_size] for i in range(0, raw.nbytes, opts.frame_size)]
                # With a base, hash first (once: the digests go on to the encoder) to find unchanged chunks.
                digests = [frame_hash(f) for f in frames] if self._base is not None else None
                reused = self._reuse(item, tensor, digests) if digests is not None else None
                if reused is not None:  # unchanged since the base: reference, don't rewrite
                    results.append((item.index, reused))
                    continue
                if out is None:
                    out = backend.open_writer(path)
                if pos % RECORD_ALIGN:
                    pad = RECORD_ALIGN - pos % RECORD_ALIGN
                    out.write(bytes(pad))
                    pos += pad
                lens, codecs, hashes = [], bytearray(), []
                start = pos
                for stored, used, digest in self._encode(frames, codec, encode_pool, digests):
                    out.write(stored)
                    pos += len(stored)
                    lens.append(len(stored))
                    codecs.append(used)
                    hashes.append(digest)
                chunk = StoredChunk(
                    file=path,
                    pos=start,
                    sizes=tuple(item.tensor_data.chunk.sizes),
                    lens=np.array(lens, dtype="<i8").tobytes(),
                    codecs=bytes(codecs),
                    hashes=b"".join(hashes),
                )
                results.append((item.index, chunk))
                del tensor, raw, frames
            if out is not None:
                out.close()
        except BaseException:
            if out is not None:
                out.abort()
            raise
        return results

    def _encode(
        self, frames: list[memoryview], codec: Codec, pool: ThreadPoolExecutor | None, digests: list[bytes] | None
    ):
        """Encode frames in order; with a pool, several at once but at most 2x threads ahead."""
        opts = self.options
        known = digests if digests is not None else [None] * len(frames)
        if pool is None:
            for f, d in zip(frames, known):
                yield encode_frame(f, codec, level=opts.level, min_saving=opts.min_saving, digest=d)
            return
        window: collections.deque = collections.deque()
        for f, d in zip(frames, known):
            window.append(pool.submit(encode_frame, f, codec, level=opts.level, min_saving=opts.min_saving, digest=d))
            if len(window) >= 2 * opts.threads:
                yield window.popleft().result()
        while window:
            yield window.popleft().result()
