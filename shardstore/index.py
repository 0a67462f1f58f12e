"""The checkpoint index: build it from DCP write results, encode/decode it as msgpack, validate it.

The index is the commit record of a checkpoint (docs/FORMAT.md has the byte layout). It is the
only place that knows where each chunk's bytes are, so it must be cheap to build for thousands
of ranks and cheap to parse on every rank: per tensor, the chunk and frame tables are stored as
little-endian arrays in msgpack ``bin`` fields (columnar), not as millions of small maps. The same
holds on the way in: each rank hands DCP its chunk table packed by column (:class:`RankChunks`),
and the coordinator groups every rank's columns by tensor with numpy, with no per-chunk Python
work; the index's checksum covers its bytes as stored, so verifying it is one pass.

Nothing here unpickles: decoding is msgpack plus strict checks of every field's type, every
array's length and every file path.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import torch
import xxhash
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.storage import WriteResult

from shardstore.backends.base import check_relpath
from shardstore.codec import HASH_NAME, HASH_SIZE, Codec
from shardstore.errors import InvalidCheckpointError
from shardstore.values import dtype_from_name, dtype_name

@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector while millions of small objects are made.

    Building or converting an index for thousands of ranks allocates millions of objects that
    hold no cycles; without this, the collector re-scans them over and over (at 128 ranks it
    made ``to_metadata`` 6x slower).
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


FORMAT_NAME = "shardstore"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class StoredChunk:
    """Where one chunk's frames landed, as a rank's writer threads record it.

    ``lens`` (int64 LE), ``codecs`` (uint8) and ``hashes`` (16 bytes each) are packed per frame.
    A rank packs all of its chunks into one :class:`RankChunks` before DCP gathers them.
    """

    file: str
    pos: int
    sizes: tuple[int, ...]
    lens: bytes
    codecs: bytes
    hashes: bytes
    base: str | None = None  # sibling checkpoint holding ``file`` (incremental reference)


@dataclass(frozen=True)
class RankChunks:
    """Every tensor chunk one rank wrote, packed by column: the ``storage_data`` of its one
    tensor ``WriteResult``.

    DCP pickles each rank's write results to gather them on the coordinator, which hands them to
    ``ShardWriter.finish``. A ``WriteResult`` per chunk costs millions of small objects to pickle,
    unpickle and walk at thousands of ranks; one object of a few byte strings per rank costs
    microseconds, and :func:`build_index` concatenates the columns with numpy. ``n`` chunks,
    ``m`` frames; byte strings are little-endian arrays:

    Attributes:
        fqns: names of the tensors the chunks belong to, as a msgpack array of str (one byte
            string unpickles in one step where a tuple of names costs an object per name, and
            the coordinator decodes each distinct list once: ranks mostly hold the same names).
        files: ``(base, path)`` of the data files the chunks lie in; ``base`` is the sibling
            checkpoint that holds the file (incremental reference) or None for this checkpoint.
        fqn: int32 [n], each chunk's tensor (position in ``fqns``).
        offsets: int64, each chunk's offset in its tensor (as many values as the tensor has
            dimensions), chunk after chunk.
        sizes: int64, each chunk's size, laid out like ``offsets``.
        file: int32 [n], each chunk's data file (position in ``files``).
        pos: int64 [n], byte offset of each chunk's first frame in its file.
        nframes: int32 [n], frames of each chunk; chunk ``i`` owns the next ``nframes[i]`` frames.
        frame_len: int64 [m], stored bytes of each frame.
        frame_codec: uint8 [m], codec id of each frame.
        frame_hash: 16 bytes x m, XXH3-128 of each frame's raw bytes.
    """

    fqns: bytes
    files: tuple[tuple[str | None, str], ...]
    fqn: bytes
    offsets: bytes
    sizes: bytes
    file: bytes
    pos: bytes
    nframes: bytes
    frame_len: bytes
    frame_codec: bytes
    frame_hash: bytes

    def __len__(self) -> int:
        """The number of chunks (``pos`` has one int64 per chunk)."""
        return len(self.pos) // 8

    def names(self) -> list[str]:
        """The tensor names ``fqn`` refers to.

        Raises:
            InvalidCheckpointError: ``fqns`` is not a msgpack array of str.
        """
        try:
            names = msgpack.unpackb(self.fqns, raw=False)
        except Exception as e:  # msgpack raises several unrelated types for garbage
            raise InvalidCheckpointError(f"write results name their tensors in invalid msgpack: {e}") from e
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise InvalidCheckpointError("write results name their tensors with something other than a list of str")
        return names

    @classmethod
    def pack(cls, chunks: Iterable[tuple[MetadataIndex, StoredChunk]]) -> RankChunks:
        """Pack a rank's ``(DCP index, chunk record)`` pairs, in the order given."""
        fqn_ids: dict[str, int] = {}
        file_ids: dict[tuple[str | None, str], int] = {}
        fqn, file, pos, nframes = [], [], [], []
        offsets: list[int] = []
        sizes: list[int] = []
        lens, codecs, hashes = [], [], []
        for index, c in chunks:
            fqn.append(fqn_ids.setdefault(index.fqn, len(fqn_ids)))
            file.append(file_ids.setdefault((c.base, c.file), len(file_ids)))
            offsets.extend(index.offset or ())
            sizes.extend(c.sizes)
            pos.append(c.pos)
            nframes.append(len(c.codecs))
            lens.append(c.lens)
            codecs.append(c.codecs)
            hashes.append(c.hashes)
        return cls(
            fqns=msgpack.packb(list(fqn_ids), use_bin_type=True),
            files=tuple(file_ids),
            fqn=np.array(fqn, dtype="<i4").tobytes(),
            offsets=np.array(offsets, dtype="<i8").tobytes(),
            sizes=np.array(sizes, dtype="<i8").tobytes(),
            file=np.array(file, dtype="<i4").tobytes(),
            pos=np.array(pos, dtype="<i8").tobytes(),
            nframes=np.array(nframes, dtype="<i4").tobytes(),
            frame_len=b"".join(lens),
            frame_codec=b"".join(codecs),
            frame_hash=b"".join(hashes),
        )


@dataclass(frozen=True)
class StoredValue:
    """A non-tensor value, msgpack-encoded: the ``storage_data`` of a bytes ``WriteResult``."""

    data: bytes


@dataclass(frozen=True)
class FileEntry:
    """A data file. ``base`` names the sibling checkpoint that holds it (incremental saves)."""

    path: str
    size: int
    base: str | None = None


@dataclass
class TensorEntry:
    """One tensor of the checkpoint: its properties and the tables of its stored chunks."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    offsets: np.ndarray  # int64 [n, ndim]
    sizes: np.ndarray  # int64 [n, ndim]
    file: np.ndarray  # int32 [n], index into Index.files
    pos: np.ndarray  # int64 [n], byte offset of the chunk's first frame in its file
    frame_start: np.ndarray  # int64 [n + 1], chunk i owns frames frame_start[i]:frame_start[i+1]
    frame_len: np.ndarray  # int64 [m], stored bytes of each frame
    frame_codec: np.ndarray  # uint8 [m]
    frame_hash: np.ndarray  # uint8 [m, 16]
    _lookup: dict[tuple[int, ...], int] | None = field(default=None, repr=False)

    @functools.cached_property
    def _frame_excl(self) -> np.ndarray:
        """Exclusive prefix sum of ``frame_len`` (length m + 1)."""
        excl = np.zeros(len(self.frame_len) + 1, dtype=np.int64)
        np.cumsum(self.frame_len, out=excl[1:])
        return excl

    @functools.cached_property
    def frame_pos(self) -> np.ndarray:
        """Byte offset in its data file of every frame (a chunk's frames lie back to back)."""
        counts = np.diff(self.frame_start)
        first = np.repeat(self.frame_start[:-1], counts)
        return np.repeat(self.pos, counts) + self._frame_excl[:-1] - self._frame_excl[first]

    def chunk_ends(self) -> np.ndarray:
        """Byte offset in its data file just past each chunk's last frame."""
        excl = self._frame_excl
        return self.pos + excl[self.frame_start[1:]] - excl[self.frame_start[:-1]]

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    def chunk_id(self, offsets: Iterable[int], hint: int | None = None) -> int:
        """The chunk that starts at ``offsets``; ``hint`` is DCP's index hint."""
        key = tuple(int(o) for o in offsets)
        if hint is not None and 0 <= hint < len(self.pos) and tuple(self.offsets[hint].tolist()) == key:
            return hint
        if self._lookup is None:
            self._lookup = {tuple(row): i for i, row in enumerate(self.offsets.tolist())}
        try:
            return self._lookup[key]
        except KeyError:
            raise InvalidCheckpointError(f"no stored chunk of this tensor starts at {list(key)}") from None

    def raw_nbytes(self, chunk: int) -> int:
        return int(np.prod(self.sizes[chunk])) * self.itemsize

    def stored_nbytes(self) -> int:
        return int(self.frame_len.sum())


@dataclass
class Index:
    """A decoded, validated index."""

    frame_size: int
    world_size: int
    created: float
    files: list[FileEntry]
    tensors: dict[str, TensorEntry]
    values: dict[str, bytes]
    planner_data: Any = None
    dcp_version: str | None = None
    user: dict[str, Any] = field(default_factory=dict)

    def to_metadata(self) -> Metadata:
        """The DCP ``Metadata`` that DCP's load planner computes read items from."""
        with _no_gc():
            return self._to_metadata()

    def _to_metadata(self) -> Metadata:
        # Two million chunks make two million ChunkStorageMetadata for DCP's planner; their
        # torch.Size fields are shared wherever the values repeat (immutable, so safe to share):
        # a chunk size is made once per distinct size, and a tensor's whole offsets table is
        # reused from an earlier tensor with the same table (the layers of a model share shapes,
        # so their shards share offsets).
        md: dict[str, Any] = {}
        size_cache: dict[tuple[int, ...], torch.Size] = {}
        offsets_cache: dict[tuple[tuple[int, ...], bytes], list[torch.Size]] = {}
        chunk = ChunkStorageMetadata
        for fqn, t in self.tensors.items():
            key = (t.offsets.shape, t.offsets.tobytes())
            offsets = offsets_cache.get(key)
            if offsets is None:
                offsets = offsets_cache[key] = list(map(torch.Size, t.offsets.tolist()))
            if len(t.sizes) and (t.sizes == t.sizes[0]).all():
                s = tuple(t.sizes[0].tolist())
                sizes: Any = itertools.repeat(size_cache.get(s) or size_cache.setdefault(s, torch.Size(s)), len(offsets))
            else:
                sizes = [size_cache.get(s) or size_cache.setdefault(s, torch.Size(s)) for s in map(tuple, t.sizes.tolist())]
            md[fqn] = TensorStorageMetadata(
                properties=TensorProperties(dtype=t.dtype),
                size=torch.Size(t.shape),
                chunks=list(map(chunk, offsets, sizes)),
            )
        for fqn in self.values:
            md[fqn] = BytesStorageMetadata()
        return Metadata(state_dict_metadata=md, planner_data=self.planner_data, version=self.dcp_version)

    def stored_nbytes(self) -> int:
        return sum(t.stored_nbytes() for t in self.tensors.values())

    def raw_nbytes(self) -> int:
        return sum(int(np.prod(t.sizes, axis=1).sum()) * t.itemsize for t in self.tensors.values())


# ---------------------------------------------------------------------------------------------
# Build (coordinator, in ShardWriter.finish)


def _planner_data_to_msgpack(planner_data: Any) -> Any:
    """DCP's default planner stores ``{fqn: tuple of keys}``; keep tuples as lists."""
    if planner_data is None:
        return None
    if isinstance(planner_data, dict) and all(
        isinstance(k, str) and isinstance(v, (tuple, list)) and all(isinstance(x, (str, int)) for x in v)
        for k, v in planner_data.items()
    ):
        return {k: list(v) for k, v in planner_data.items()}
    raise InvalidCheckpointError(
        "the save planner's planner_data is not a mapping of names to key paths; "
        "shardstore stores it as msgpack and cannot keep arbitrary objects"
    )


def build_index(
    metadata: Metadata,
    results: list[list[WriteResult]],
    *,
    frame_size: int,
    files: dict[tuple[str | None, str], FileEntry] | None = None,
    user: dict[str, Any] | None = None,
) -> Index:
    """Assemble the index from every rank's write results.

    Args:
        metadata: the global ``Metadata`` from DCP's planner (dtypes, global shapes).
        results: ``results[rank]`` is that rank's list of ``WriteResult``: one whose
            ``storage_data`` is a :class:`RankChunks` (its tensor chunks) and one
            :class:`StoredValue` per non-tensor value.
        frame_size: the raw frame size the ranks wrote with.
        files: entries of files that live in sibling checkpoints (incremental references),
            keyed by ``(base, path)`` as the chunks name them.
        user: free-form msgpack-able metadata (the manager's step, say).

    Raises:
        InvalidCheckpointError: a write result of an unknown kind, for a tensor DCP's metadata
            does not have, or with inconsistent columns.
    """
    with _no_gc():
        packed: list[tuple[int, RankChunks]] = []
        values: dict[str, bytes] = {}
        for rank, rank_results in enumerate(results):
            for wr in rank_results:
                sd = wr.storage_data
                if type(sd) is RankChunks:
                    packed.append((rank, sd))
                elif isinstance(sd, StoredValue):
                    values[wr.index.fqn] = sd.data
                else:
                    raise InvalidCheckpointError(
                        f"unexpected write result for {wr.index.fqn}: {type(sd).__name__}"
                    )
        chunks = _Columns.concat(packed, metadata)
        tensors = chunks.tensors()
        external = files or {}
        file_end = chunks.file_ends()
        file_list = [
            external.get(key) or FileEntry(path=key[1], size=int(file_end[fid]), base=key[0])
            for fid, key in enumerate(chunks.file_keys)
        ]
    return Index(
        frame_size=frame_size,
        world_size=len(results),
        created=time.time(),
        files=file_list,
        tensors=tensors,
        values=values,
        planner_data=metadata.planner_data,
        dcp_version=metadata.version,
        user=dict(user or {}),
    )


def _excl_cumsum(counts: np.ndarray) -> np.ndarray:
    """``[0, c0, c0 + c1, ...]`` (length ``len(counts) + 1``, int64)."""
    out = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=out[1:])
    return out


def _local_to_global(
    local: np.ndarray, counts: np.ndarray, luts: list[np.ndarray], what: str, ranks: list[int]
) -> np.ndarray:
    """Map each chunk's rank-local table position to a global id through its rank's table."""
    if not len(local):
        return np.zeros(0, dtype=np.int32)
    lut_len = np.fromiter(map(len, luts), dtype=np.int64, count=len(luts))
    has = np.flatnonzero(counts)  # ranks with chunks: the per-rank extremes of their positions
    starts = _excl_cumsum(counts)[has]
    low, high = np.minimum.reduceat(local, starts), np.maximum.reduceat(local, starts)
    bad = np.flatnonzero((low < 0) | (high >= lut_len[has]))
    if len(bad):
        raise InvalidCheckpointError(f"write results of rank {ranks[has[bad[0]]]} name a {what} outside their table")
    if all(lut is luts[0] for lut in luts):  # every rank holds the same names (the usual case)
        return luts[0][local]
    return np.concatenate(luts)[np.repeat(_excl_cumsum(lut_len)[:-1], counts) + local]


@dataclass
class _Columns:
    """Every rank's chunk columns, concatenated in rank order, with global tensor and file ids."""

    fqn_names: list[str]  # by global tensor id
    file_keys: list[tuple[str | None, str]]  # by global file id
    metadata: list[TensorStorageMetadata]  # by global tensor id
    tid: np.ndarray  # [n] global tensor id
    ndim: np.ndarray  # [n]
    offsets: np.ndarray  # flat int64, ndim[i] values per chunk
    sizes: np.ndarray  # flat int64
    file: np.ndarray  # [n] global file id
    pos: np.ndarray  # [n]
    nframes: np.ndarray  # [n]
    frame_len: np.ndarray  # [m]
    frame_codec: np.ndarray  # [m]
    frame_hash: np.ndarray  # [m, 16]

    @classmethod
    def concat(cls, packed: list[tuple[int, RankChunks]], metadata: Metadata) -> _Columns:
        ranks = [rank for rank, _ in packed]
        parts = [rc for _, rc in packed]
        fqn_ids: dict[str, int] = {}
        file_ids: dict[tuple[str | None, str], int] = {}
        fqn_luts: dict[bytes, np.ndarray] = {}  # ranks of a job mostly hold the same names
        named_by: list[int] = []  # by global tensor id: the first rank that named it (for messages)
        fqn_parts, file_parts = [], []
        for rank, rc in packed:
            lut = fqn_luts.get(rc.fqns)
            if lut is None:
                try:
                    names = rc.names()
                except InvalidCheckpointError as e:
                    raise InvalidCheckpointError(f"write results of rank {rank}: {e}") from None
                ids = []
                for f in names:
                    if f not in fqn_ids:
                        fqn_ids[f] = len(fqn_ids)
                        named_by.append(rank)
                    ids.append(fqn_ids[f])
                lut = fqn_luts[rc.fqns] = np.array(ids, dtype=np.int32)
            fqn_parts.append(lut)
            file_parts.append(np.array([file_ids.setdefault(k, len(file_ids)) for k in rc.files], dtype=np.int32))
        counts = np.fromiter(map(len, parts), dtype=np.int64, count=len(parts))
        bounds = _excl_cumsum(counts)

        def column(name: str, dtype: str, per_rank: np.ndarray) -> np.ndarray:
            """The column ``name`` of every rank, after checking each rank's length."""
            itemsize = np.dtype(dtype).itemsize
            got = np.fromiter((len(getattr(rc, name)) for rc in parts), dtype=np.int64, count=len(parts))
            bad = np.flatnonzero(got != per_rank * itemsize)
            if len(bad):
                i = int(bad[0])
                raise InvalidCheckpointError(
                    f"write results of rank {ranks[i]} have {got[i]} bytes of chunk column {name!r}, "
                    f"expected {per_rank[i] * itemsize} for its {counts[i]} chunks"
                )
            return np.frombuffer(b"".join([getattr(rc, name) for rc in parts]), dtype=dtype)

        tid = _local_to_global(column("fqn", "<i4", counts).astype(np.int64), counts, fqn_parts, "tensor", ranks)
        fid = _local_to_global(column("file", "<i4", counts).astype(np.int64), counts, file_parts, "data file", ranks)
        fqn_names = list(fqn_ids)
        unused = np.flatnonzero(np.bincount(tid, minlength=len(fqn_names)) == 0)
        if len(unused):  # a tensor without chunks would load as "nothing to read"
            t = int(unused[0])
            raise InvalidCheckpointError(
                f"write results of rank {named_by[t]} name tensor {fqn_names[t]!r} but hold no chunk of it"
            )
        smds = []
        for t, fqn in enumerate(fqn_names):
            smd = metadata.state_dict_metadata.get(fqn)
            if not isinstance(smd, TensorStorageMetadata):
                raise InvalidCheckpointError(
                    f"write results of rank {named_by[t]} hold tensor {fqn!r}, which has no tensor metadata"
                )
            smds.append(smd)
        ndim = np.array([len(smd.size) for smd in smds], dtype=np.int64)[tid]
        nvals = np.diff(_excl_cumsum(ndim)[bounds])
        nframes = column("nframes", "<i4", counts).astype(np.int64)
        if (nframes < 0).any():
            bad = int(np.flatnonzero(nframes < 0)[0])
            rank = ranks[int(np.searchsorted(bounds, bad, side="right")) - 1]
            raise InvalidCheckpointError(f"write results of rank {rank} have negative frame counts")
        m = np.diff(_excl_cumsum(nframes)[bounds])
        return cls(
            fqn_names=fqn_names,
            file_keys=list(file_ids),
            metadata=smds,
            tid=tid,
            ndim=ndim,
            offsets=column("offsets", "<i8", nvals),
            sizes=column("sizes", "<i8", nvals),
            file=fid,
            pos=column("pos", "<i8", counts),
            nframes=nframes,
            frame_len=column("frame_len", "<i8", m),
            frame_codec=column("frame_codec", "u1", m),
            frame_hash=column("frame_hash", "u1", m * HASH_SIZE).reshape(-1, HASH_SIZE),
        )

    def file_ends(self) -> np.ndarray:
        """Per global file id, where its last chunk ends (the file's size)."""
        end = np.zeros(len(self.file_keys), dtype=np.int64)
        if not len(self.pos):
            return end
        if len(self.frame_len) == len(self.pos) and (self.nframes == 1).all():  # one frame per chunk
            ends = self.pos + self.frame_len
        else:
            flen = _excl_cumsum(self.frame_len)
            fstart = _excl_cumsum(self.nframes)
            ends = self.pos + flen[fstart[1:]] - flen[fstart[:-1]]
        # Chunks come in runs of one file (a rank's files one after the other): max per run, then per file.
        starts = np.concatenate(([0], np.flatnonzero(self.file[1:] != self.file[:-1]) + 1))
        np.maximum.at(end, self.file[starts], np.maximum.reduceat(ends, starts))
        return end

    def tensors(self) -> dict[str, TensorEntry]:
        """Group the chunks by tensor (rank order within a tensor) into per-tensor tables."""
        n = len(self.tid)
        ndims = np.array([len(smd.size) for smd in self.metadata], dtype=np.int64)
        counts = np.bincount(self.tid, minlength=len(self.fqn_names))
        start = _excl_cumsum(counts)
        order = np.argsort(self.tid, kind="stable") if n and (self.tid[1:] < self.tid[:-1]).any() else None

        def take(a: np.ndarray) -> np.ndarray:
            return a if order is None else _take_rows(a, order)

        single = len(self.frame_len) == n and (self.nframes == 1).all()  # one frame per chunk, the common case
        nframes = self.nframes if single else take(self.nframes)
        fstart = _excl_cumsum(nframes)  # frame tables in tensor order
        if order is None:
            frames = None
        elif single:
            frames = order
        else:
            frames = np.repeat(_excl_cumsum(self.nframes)[:-1][order] - fstart[:-1], nframes) + np.arange(fstart[-1])
        frame_len, frame_codec, frame_hash_ = (
            (a if frames is None else _take_rows(a, frames)) for a in (self.frame_len, self.frame_codec, self.frame_hash)
        )
        file, pos = take(self.file), take(self.pos)
        # offsets/sizes as [k, d] tables, one per number of dimensions d; a tensor's rows are contiguous in it.
        tables: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        row = start[:-1]  # each tensor's first row in its table
        if len(set(ndims.tolist())) == 1:
            d = int(ndims[0])
            tables[d] = (take(self.offsets.reshape(n, d)), take(self.sizes.reshape(n, d)))
        else:
            ndim = np.repeat(ndims, counts)
            vstart = take(_excl_cumsum(self.ndim)[:-1])
            rows = np.zeros(n, dtype=np.int64)
            for d in np.unique(ndims).tolist():
                sel = np.flatnonzero(ndim == d)
                at = vstart[sel][:, None] + np.arange(d)
                tables[d] = (self.offsets[at], self.sizes[at])
                rows[sel] = np.arange(len(sel))
            row = rows[start[:-1]]
        out: dict[str, TensorEntry] = {}
        for t, (fqn, smd) in enumerate(zip(self.fqn_names, self.metadata)):
            a, b = int(start[t]), int(start[t + 1])
            offsets, sizes = tables[int(ndims[t])]
            r = int(row[t])
            fa, fb = int(fstart[a]), int(fstart[b])
            out[fqn] = TensorEntry(
                dtype=smd.properties.dtype,
                shape=tuple(smd.size),
                offsets=offsets[r : r + b - a],
                sizes=sizes[r : r + b - a],
                file=file[a:b],
                pos=pos[a:b],
                frame_start=fstart[a : b + 1] - fa,
                frame_len=frame_len[fa:fb],
                frame_codec=frame_codec[fa:fb],
                frame_hash=frame_hash_[fa:fb],
            )
        return out


def _take_rows(a: np.ndarray, index: np.ndarray) -> np.ndarray:
    """``a[index]``; rows of a 2-D array are moved as one opaque item each (several times faster)."""
    if a.ndim == 2 and a.shape[1] > 1 and a.flags.c_contiguous:
        rows = a.view(np.dtype((np.void, a.shape[1] * a.itemsize))).reshape(-1)
        return rows[index].view(a.dtype).reshape(len(index), a.shape[1])
    return a[index]


# ---------------------------------------------------------------------------------------------
# Encode / decode


def _le(a: np.ndarray, dtype: str) -> memoryview:
    """The bytes of ``a`` as a little-endian ``dtype`` array (msgpack packs a memoryview as bin)."""
    return memoryview(np.ascontiguousarray(a, dtype=dtype).reshape(-1))


def encode_index(index: Index) -> bytes:
    """Serialise ``index`` to msgpack bytes (docs/FORMAT.md)."""
    tensors = {}
    for fqn, t in index.tensors.items():
        tensors[fqn] = {
            "dtype": dtype_name(t.dtype),
            "shape": list(t.shape),
            "offsets": _le(t.offsets, "<i8"),
            "sizes": _le(t.sizes, "<i8"),
            "file": _le(t.file, "<i4"),
            "pos": _le(t.pos, "<i8"),
            "nframes": _le(np.diff(t.frame_start), "<i4"),
            "frame_len": _le(t.frame_len, "<i8"),
            "frame_codec": _le(t.frame_codec, "u1"),
            "frame_hash": _le(t.frame_hash, "u1"),
        }
    doc = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "hash": HASH_NAME,
        "frame_size": index.frame_size,
        "world_size": index.world_size,
        "created": index.created,
        "dcp_version": index.dcp_version,
        "files": [
            {"path": f.path, "size": f.size, **({"base": f.base} if f.base is not None else {})}
            for f in index.files
        ],
        "tensors": tensors,
        "values": index.values,
        "planner_data": _planner_data_to_msgpack(index.planner_data),
        "user": index.user,
    }
    # One map with index_hash as its last entry, hashed over what precedes it (see _index_hash_ok).
    packer = msgpack.Packer(use_bin_type=True, autoreset=False)
    packer.pack_map_header(len(doc) + 1)
    for key, value in doc.items():
        packer.pack(key)
        packer.pack(value)
    digest = xxhash.xxh3_128(_map_header(len(doc)))
    with packer.getbuffer() as body:
        digest.update(body[len(_map_header(len(doc) + 1)) :])
    packer.pack("index_hash")
    packer.pack(digest.digest())
    return packer.bytes()


# ``index_hash`` is the last entry of the index map: its key (a 10-byte fixstr) and a bin 8 header
# of length 16 come right before the digest at the very end of the index.
_HASH_KEY = msgpack.packb("index_hash") + b"\xc4" + bytes([HASH_SIZE])
_HASH_TAIL = len(_HASH_KEY) + HASH_SIZE


def _map_header(n: int) -> bytes:
    """msgpack's (shortest) header of a map of ``n`` entries, as ``msgpack.packb`` writes it."""
    if n < 16:
        return bytes([0x80 | n])
    if n < 1 << 16:
        return b"\xde" + n.to_bytes(2, "big")
    return b"\xdf" + n.to_bytes(4, "big")


def _map_header_len(data: bytes | memoryview) -> int:
    """Length of the map header that ``data`` starts with (0 if it does not start with a map)."""
    first = data[0] if len(data) else 0
    if 0x80 <= first <= 0x8F:
        return 1
    return {0xDE: 3, 0xDF: 5}.get(first, 0)


def _index_hash_ok(data: bytes, doc: dict) -> bool:
    """Whether the digest that ends ``data`` is the XXH3-128 of the index without it.

    The digest covers the bytes as stored (one pass, nothing re-encoded): the map header re-written
    for one entry fewer, then every entry before ``index_hash``. For a map written by
    ``msgpack.packb`` that is exactly the msgpack encoding of the map without ``index_hash``.
    """
    head = _map_header_len(data)
    if (
        not head
        or len(data) < head + _HASH_TAIL
        or not isinstance(doc.get("index_hash"), bytes)
        or next(reversed(doc)) != "index_hash"
        or data[len(data) - _HASH_TAIL : len(data) - HASH_SIZE] != _HASH_KEY
    ):
        return False
    h = xxhash.xxh3_128(_map_header(len(doc) - 1))
    h.update(memoryview(data)[head : len(data) - _HASH_TAIL])
    return h.digest() == data[len(data) - HASH_SIZE :]


def _need(doc: dict, key: str, types: type | tuple[type, ...], where: str) -> Any:
    if key not in doc:
        raise InvalidCheckpointError(f"index is missing {where}{key!r}")
    value = doc[key]
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,))):
        raise InvalidCheckpointError(f"index field {where}{key!r} has type {type(value).__name__}")
    return value


def _array(doc: dict, key: str, dtype: str, count: int, where: str) -> np.ndarray:
    raw = _need(doc, key, bytes, where)
    itemsize = np.dtype(dtype).itemsize
    if len(raw) != count * itemsize:
        raise InvalidCheckpointError(f"index field {where}{key!r} has {len(raw)} bytes, expected {count * itemsize}")
    return np.frombuffer(raw, dtype=dtype)


_KNOWN_CODEC = np.zeros(256, dtype=bool)
_KNOWN_CODEC[[c.value for c in Codec]] = True


def _check_tables(where: str, t: TensorEntry, frame_size: int, file_sizes: np.ndarray) -> None:
    """Cross-check a tensor's tables: frame counts, codecs, raw frame lengths, file extents."""
    n = len(t.pos)
    if n == 0:
        return
    nframes = np.diff(t.frame_start)
    raw_len = np.prod(t.sizes, axis=1) * t.itemsize if t.sizes.shape[1] else np.full(n, t.itemsize)
    if (nframes != (raw_len + frame_size - 1) // frame_size).any():
        raise InvalidCheckpointError(f"index entry {where} has frame counts that do not match its chunk sizes")
    if not _KNOWN_CODEC[t.frame_codec].all():
        raise InvalidCheckpointError(f"index entry {where} has an unknown frame codec")
    if len(t.frame_len) == n and (nframes == 1).all():  # one frame per chunk, the common case
        raw_frame = raw_len
    else:
        owner = np.repeat(np.arange(n), nframes)
        k = np.arange(len(t.frame_len)) - t.frame_start[owner]
        raw_frame = np.minimum(frame_size, raw_len[owner] - k * frame_size)
    raw = t.frame_codec == Codec.RAW
    if (t.frame_len[raw] != raw_frame[raw]).any() or (t.frame_len <= 0).any():
        raise InvalidCheckpointError(f"index entry {where} has frame lengths that do not match their codecs")
    if (t.chunk_ends() > file_sizes[t.file]).any():
        raise InvalidCheckpointError(f"index entry {where} has frames past the end of their data file")


def _decode_tensor(fqn: str, doc: Any, nfiles: int) -> TensorEntry:
    where = f"tensors[{fqn!r}]."
    if not isinstance(doc, dict):
        raise InvalidCheckpointError(f"index entry {where[:-1]} is not a map")
    dtype = dtype_from_name(_need(doc, "dtype", str, where))
    shape = _need(doc, "shape", list, where)
    if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
        raise InvalidCheckpointError(f"index field {where}'shape' is not a list of sizes: {shape!r}")
    ndim = len(shape)
    n = len(_need(doc, "pos", bytes, where)) // 8
    offsets = _array(doc, "offsets", "<i8", n * ndim, where).reshape(n, ndim)
    sizes = _array(doc, "sizes", "<i8", n * ndim, where).reshape(n, ndim)
    if n and ((offsets < 0).any() or (sizes < 0).any() or (offsets + sizes > np.array(shape, dtype=np.int64)).any()):
        raise InvalidCheckpointError(f"index entry {where[:-1]} has a chunk outside the tensor's shape {shape}")
    file = _array(doc, "file", "<i4", n, where)
    if n and ((file < 0).any() or (file >= nfiles).any()):
        raise InvalidCheckpointError(f"index entry {where[:-1]} names a file that is not in the file table")
    pos = _array(doc, "pos", "<i8", n, where)
    nframes = _array(doc, "nframes", "<i4", n, where).astype(np.int64)
    if (nframes < 0).any() or (pos < 0).any():
        raise InvalidCheckpointError(f"index entry {where[:-1]} has negative positions or frame counts")
    frame_start = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(nframes, out=frame_start[1:])
    m = int(frame_start[-1])
    frame_len = _array(doc, "frame_len", "<i8", m, where)
    if (frame_len < 0).any():
        raise InvalidCheckpointError(f"index entry {where[:-1]} has negative frame lengths")
    return TensorEntry(
        dtype=dtype,
        shape=tuple(shape),
        offsets=offsets,
        sizes=sizes,
        file=file,
        pos=pos,
        frame_start=frame_start,
        frame_len=frame_len,
        frame_codec=_array(doc, "frame_codec", "u1", m, where),
        frame_hash=_array(doc, "frame_hash", "u1", m * HASH_SIZE, where).reshape(m, HASH_SIZE),
    )


def decode_index(data: bytes, *, source: str = "index") -> Index:
    """Parse and validate index bytes. Raises ``InvalidCheckpointError`` naming ``source``."""
    try:
        doc = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types for garbage
        raise InvalidCheckpointError(f"{source} is not a shardstore index (not valid msgpack: {e})") from e
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise InvalidCheckpointError(f"{source} is not a shardstore index (no 'format: shardstore' field)")
    version = doc.get("version")
    if version != FORMAT_VERSION:
        raise InvalidCheckpointError(
            f"{source} has format version {version!r}; this shardstore reads version {FORMAT_VERSION}"
        )
    try:
        if _need(doc, "hash", str, "") != HASH_NAME:
            raise InvalidCheckpointError(f"{source} uses checksum {doc['hash']!r}; expected {HASH_NAME!r}")
        frame_size = _need(doc, "frame_size", int, "")
        if frame_size <= 0 or frame_size % 8:
            raise InvalidCheckpointError(f"{source} has an invalid frame_size {frame_size}")
        files = []
        for i, f in enumerate(_need(doc, "files", list, "")):
            if not isinstance(f, dict):
                raise InvalidCheckpointError(f"{source} file entry {i} is not a map")
            base = f.get("base")
            if base is not None:
                if not isinstance(base, str) or "/" in base:
                    raise InvalidCheckpointError(f"file entry base leaves the checkpoint's parent: {base!r}")
                check_relpath(base)
            files.append(
                FileEntry(path=check_relpath(_need(f, "path", str, "files[].")), size=_need(f, "size", int, "files[]."), base=base)
            )
        tensors = {}
        file_sizes = np.array([f.size for f in files], dtype=np.int64)
        for fqn, t in _need(doc, "tensors", dict, "").items():
            tensors[fqn] = _decode_tensor(fqn, t, len(files))
            _check_tables(f"tensors[{fqn!r}]", tensors[fqn], frame_size, file_sizes)
        values = _need(doc, "values", dict, "")
        for k, v in values.items():
            if not isinstance(v, bytes):
                raise InvalidCheckpointError(f"{source} value {k!r} is not msgpack bytes")
        planner_data = doc.get("planner_data")
        if isinstance(planner_data, dict):
            planner_data = {k: tuple(v) if isinstance(v, list) else v for k, v in planner_data.items()}
        user = doc.get("user") or {}
        if not isinstance(user, dict):
            raise InvalidCheckpointError(f"{source} field 'user' is not a map")
        world_size = _need(doc, "world_size", int, "")
        created = float(_need(doc, "created", (int, float), ""))
        # Last, after the checks that name what is wrong: damage those checks cannot see.
        if not _index_hash_ok(data, doc):
            raise InvalidCheckpointError(f"{source}: index checksum mismatch (the index is damaged)")
        return Index(
            frame_size=frame_size,
            world_size=world_size,
            created=created,
            files=files,
            tensors=tensors,
            values=values,
            planner_data=planner_data,
            dcp_version=doc.get("dcp_version") if isinstance(doc.get("dcp_version"), str) else None,
            user=user,
        )
    except InvalidCheckpointError as e:
        if str(e).startswith(source):
            raise
        raise InvalidCheckpointError(f"{source}: {e}") from e
