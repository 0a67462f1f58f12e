"""The checkpoint index: build it from DCP write results, encode/decode it as msgpack, validate it.

The index is the commit record of a checkpoint (docs/FORMAT.md has the byte layout). It is the
only place that knows where each chunk's bytes are, so it must be cheap to build for thousands
of ranks and cheap to parse on every rank: per tensor, the chunk and frame tables are stored as
little-endian arrays in msgpack ``bin`` fields (columnar), not as millions of small maps.

Nothing here unpickles: decoding is msgpack plus strict checks of every field's type, every
array's length and every file path.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.storage import WriteResult

from shardstore.backends.base import check_relpath
from shardstore.codec import HASH_NAME, HASH_SIZE, Codec, frame_hash
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
    """Where one chunk's frames landed: the ``storage_data`` of a tensor's ``WriteResult``.

    Sent from each rank to the coordinator, so it is small and frozen. ``lens`` (int64),
    ``codecs`` (uint8) and ``hashes`` (16 bytes each) are packed per frame.
    """

    file: str
    pos: int
    sizes: tuple[int, ...]
    lens: bytes
    codecs: bytes
    hashes: bytes
    base: str | None = None  # sibling checkpoint holding ``file`` (incremental reference)


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
        return torch.empty((), dtype=self.dtype).element_size()

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
        md: dict[str, Any] = {}
        size_cache: dict[tuple[int, ...], torch.Size] = {}  # chunks of a tensor mostly share sizes
        for fqn, t in self.tensors.items():
            sizes = [tuple(s) for s in t.sizes.tolist()]
            chunks = [
                ChunkStorageMetadata(offsets=torch.Size(o), sizes=size_cache.get(s) or size_cache.setdefault(s, torch.Size(s)))
                for o, s in zip(t.offsets.tolist(), sizes)
            ]
            md[fqn] = TensorStorageMetadata(
                properties=TensorProperties(dtype=t.dtype), size=torch.Size(t.shape), chunks=chunks
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
    """Assemble the index from every rank's write results (see :func:`_build_index`)."""
    with _no_gc():
        return _build_index(metadata, results, frame_size=frame_size, files=files, user=user)


def _build_index(
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
        results: ``results[rank]`` is that rank's list of ``WriteResult``.
        frame_size: the raw frame size the ranks wrote with.
        files: entries of files that live in sibling checkpoints (incremental references),
            keyed by ``(base, path)`` as the chunks name them.
        user: free-form msgpack-able metadata (the manager's step, say).
    """
    external = files or {}
    per_tensor: dict[str, list[WriteResult]] = {}
    values: dict[str, bytes] = {}
    for rank_results in results:  # the one pass over every chunk: keep it lean
        for wr in rank_results:
            if type(wr.storage_data) is StoredChunk:
                per_tensor.setdefault(wr.index.fqn, []).append(wr)
            elif isinstance(wr.storage_data, StoredValue):
                values[wr.index.fqn] = wr.storage_data.data
            else:
                raise InvalidCheckpointError(
                    f"unexpected write result for {wr.index.fqn}: {type(wr.storage_data).__name__}"
                )

    file_ids: dict[tuple[str | None, str], int] = {}
    tensors: dict[str, TensorEntry] = {}
    for fqn, chunks in per_tensor.items():
        smd = metadata.state_dict_metadata.get(fqn)
        if not isinstance(smd, TensorStorageMetadata):
            raise InvalidCheckpointError(f"write result for {fqn!r} has no tensor metadata")
        ndim = len(smd.size)
        n = len(chunks)
        sds = [wr.storage_data for wr in chunks]
        nframes = np.fromiter(map(len, (sd.codecs for sd in sds)), dtype=np.int64, count=n)
        frame_start = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(nframes, out=frame_start[1:])
        keys = [(sd.base, sd.file) for sd in sds]
        tensors[fqn] = TensorEntry(
            dtype=smd.properties.dtype,
            shape=tuple(smd.size),
            offsets=np.array([wr.index.offset or () for wr in chunks], dtype=np.int64).reshape(n, ndim),
            sizes=np.array([sd.sizes for sd in sds], dtype=np.int64).reshape(n, ndim),
            file=np.fromiter((file_ids.setdefault(k, len(file_ids)) for k in keys), dtype=np.int32, count=n),
            pos=np.fromiter((sd.pos for sd in sds), dtype=np.int64, count=n),
            frame_start=frame_start,
            frame_len=np.frombuffer(b"".join([sd.lens for sd in sds]), dtype="<i8").astype(np.int64),
            frame_codec=np.frombuffer(b"".join([sd.codecs for sd in sds]), dtype=np.uint8),
            frame_hash=np.frombuffer(b"".join([sd.hashes for sd in sds]), dtype=np.uint8).reshape(-1, HASH_SIZE),
        )

    # A data file's size is where its last chunk ends (vectorised over every tensor's chunks).
    file_end = np.zeros(len(file_ids), dtype=np.int64)
    for t in tensors.values():
        np.maximum.at(file_end, t.file, t.chunk_ends())
    file_list = [
        external.get(key) or FileEntry(path=key[1], size=int(file_end[fid]), base=key[0])
        for key, fid in sorted(file_ids.items(), key=lambda kv: kv[1])
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


# ---------------------------------------------------------------------------------------------
# Encode / decode


def _le(a: np.ndarray, dtype: str) -> bytes:
    return np.ascontiguousarray(a, dtype=dtype).tobytes()


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
    doc["index_hash"] = frame_hash(msgpack.packb(doc, use_bin_type=True))
    return msgpack.packb(doc, use_bin_type=True)


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


_CODECS = np.array([c.value for c in Codec], dtype=np.uint8)


def _check_tables(where: str, t: TensorEntry, frame_size: int, files: list[FileEntry]) -> None:
    """Cross-check a tensor's tables: frame counts, codecs, raw frame lengths, file extents."""
    n = len(t.pos)
    if n == 0:
        return
    nframes = np.diff(t.frame_start)
    raw_len = np.prod(t.sizes, axis=1) * t.itemsize if t.sizes.shape[1] else np.full(n, t.itemsize)
    if (nframes != (raw_len + frame_size - 1) // frame_size).any():
        raise InvalidCheckpointError(f"index entry {where} has frame counts that do not match its chunk sizes")
    if not np.isin(t.frame_codec, _CODECS).all():
        raise InvalidCheckpointError(f"index entry {where} has an unknown frame codec")
    owner = np.repeat(np.arange(n), nframes)
    k = np.arange(len(t.frame_len)) - t.frame_start[owner]
    raw_frame = np.minimum(frame_size, raw_len[owner] - k * frame_size)
    raw = t.frame_codec == Codec.RAW
    if (t.frame_len[raw] != raw_frame[raw]).any() or (t.frame_len <= 0).any():
        raise InvalidCheckpointError(f"index entry {where} has frame lengths that do not match their codecs")
    sizes = np.array([f.size for f in files], dtype=np.int64)
    if (t.chunk_ends() > sizes[t.file]).any():
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
        for fqn, t in _need(doc, "tensors", dict, "").items():
            tensors[fqn] = _decode_tensor(fqn, t, len(files))
            _check_tables(f"tensors[{fqn!r}]", tensors[fqn], frame_size, files)
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
        expected = doc.pop("index_hash", None)
        if not isinstance(expected, bytes) or frame_hash(msgpack.packb(doc, use_bin_type=True)) != expected:
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
