"""The index at scale: packed per-rank write results -> build -> encode -> decode -> DCP Metadata.

A reference model (plain Python lists, one record per chunk) is checked against what
``build_index`` makes of the same chunks packed per rank as ``ShardWriter.write_data`` packs
them, and against the decoded index, field by field: uneven and 2-D shards, scalars, several
chunks of one tensor on one rank in any order, several frames per chunk, zstd codecs, several
files per rank and chunks that point into an incremental base. Real multi-rank saves are covered
by test_core_dist, test_incremental_core, test_manager, test_async and test_compression.
"""

from __future__ import annotations

import dataclasses
import math
import pickle
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.storage import WriteResult

from benchmarks.bench_index import _metadata, simulate
from shardstore import ShardReader, ShardWriter
from shardstore.errors import InvalidCheckpointError
from shardstore.index import (
    FileEntry,
    Index,
    RankChunks,
    StoredChunk,
    StoredValue,
    build_index,
    decode_index,
    encode_index,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

FRAME = 256  # small frames, so that chunks have several
BASE = "step-000000000001"
DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.float16, torch.uint8]


@dataclasses.dataclass
class Chunk:
    """The reference model of one stored chunk."""

    rank: int
    fqn: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    base: str | None
    path: str
    pos: int
    lens: list[int]
    codecs: list[int]
    hashes: bytes


def _splits(n: int, parts: int) -> list[tuple[int, int]]:
    """(start, length) of ``parts`` uneven pieces of ``n`` (some may be empty)."""
    edges = np.linspace(0, n, parts + 1).astype(int) if n >= parts else np.minimum(np.arange(parts + 1), n)
    return [(int(a), int(b - a)) for a, b in zip(edges[:-1], edges[1:])]


def _layout(ranks: int, ntensors: int) -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...]]], list[list[tuple]]]:
    """Tensors (dtype, shape) and, per rank, its chunks as (fqn, offsets, sizes), in write order."""
    tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    per_rank: list[list[tuple]] = [[] for _ in range(ranks)]
    grid = (ranks // 8, 8)
    for t in range(ntensors):
        fqn, dtype, kind = f"layers.{t}.w{t % 5}", DTYPES[t % len(DTYPES)], t % 5
        if kind == 0:  # FSDP Shard(0), uneven, the last ranks' shards empty
            shape = (ranks * 3 - 5 + t % 7, 33)
            for r, (a, n) in enumerate(_splits(shape[0], ranks)):
                per_rank[r].append((fqn, (a, 0), (n, shape[1])))
        elif kind == 1:  # 2-D mesh [Shard(0), Shard(1)], uneven blocks
            shape = (grid[0] * 5 + 3, 8 * 9 - 2)
            rows, cols = _splits(shape[0], grid[0]), _splits(shape[1], grid[1])
            for r in range(ranks):
                (a, n), (b, m) = rows[r // 8], cols[r % 8]
                per_rank[r].append((fqn, (a, b), (n, m)))
        elif kind == 2:  # replicated 1-D tensor, written once by one rank (DCP's dedup)
            shape = (100 + t,)
            per_rank[t % ranks].append((fqn, (0,), shape))
        elif kind == 3:  # a scalar
            shape = ()
            per_rank[(t * 7) % ranks].append((fqn, (), ()))
        else:  # two chunks per rank (ShardedTensor-like), written in descending offset order on odd ranks
            shape = (ranks * 4, 17)
            pieces = _splits(shape[0], 2 * ranks)
            for r in range(ranks):
                mine = [pieces[r], pieces[r + ranks]]
                for a, n in mine[::-1] if r % 2 else mine:
                    per_rank[r].append((fqn, (a, 0), (n, shape[1])))
        tensors[fqn] = (dtype, shape)
    return tensors, per_rank


def _simulate(ranks: int, ntensors: int, seed: int = 0) -> tuple[Metadata, list[list[WriteResult]], list[Chunk], dict]:
    """Write results as ``ShardWriter`` packs them, the reference chunks, and the base's files."""
    rng = np.random.default_rng(seed)
    tensors, per_rank = _layout(ranks, ntensors)
    chunks: list[Chunk] = []
    results: list[list[WriteResult]] = []
    external: dict[tuple[str | None, str], FileEntry] = {}
    for r, items in enumerate(per_rank):
        file_pos = [0, 0]
        records = []
        for k, (fqn, offsets, sizes) in enumerate(items):
            dtype, _ = tensors[fqn]
            raw = math.prod(sizes) * dtype.itemsize
            raw_frames = [min(FRAME, raw - i) for i in range(0, raw, FRAME)]
            codecs = [int(c) for c in rng.choice([0, 0, 1, 2, 3], size=len(raw_frames))]
            lens = [n if c == 0 else int(rng.integers(1, n + 1)) for n, c in zip(raw_frames, codecs)]
            if r % 3 == 0 and k % 4 == 1:  # unchanged since the base: a reference into its file
                base, path, pos = BASE, f"data-0ld000000000-r{r:05d}-00.bin", int(rng.integers(0, 1000)) * 64
                key = (base, path)
                size = max(external[key].size if key in external else 0, pos + sum(lens) + 64)
                external[key] = FileEntry(path=path, size=size, base=base)
            else:
                f = k % 2
                base, path, pos = None, f"data-0123456789ab-r{r:05d}-{f:02d}.bin", -(-file_pos[f] // 64) * 64
                file_pos[f] = pos + sum(lens)
            chunk = Chunk(r, fqn, offsets, sizes, base, path, pos, lens, codecs, rng.bytes(16 * len(lens)))
            chunks.append(chunk)
            records.append((
                MetadataIndex(fqn, torch.Size(offsets), k),
                StoredChunk(file=path, pos=pos, sizes=sizes, lens=np.array(lens, dtype="<i8").tobytes(),
                            codecs=bytes(codecs), hashes=chunk.hashes, base=base),
            ))
        rank_results = [WriteResult(MetadataIndex("<rank>", index=r), 0, RankChunks.pack(records))]
        if r == 1:
            rank_results.insert(0, WriteResult(MetadataIndex("step"), 3, StoredValue(msgpack.packb(17))))
        results.append(pickle.loads(pickle.dumps(rank_results)))  # what DCP's gather delivers
    md = Metadata(state_dict_metadata={
        fqn: TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(shape), chunks=[])
        for fqn, (dtype, shape) in tensors.items()
    })
    md.state_dict_metadata["step"] = BytesStorageMetadata()
    return md, results, chunks, external


def _expected(chunks: list[Chunk]) -> dict[str, list[Chunk]]:
    out: dict[str, list[Chunk]] = {}
    for c in chunks:  # rank order, then each rank's write order
        out.setdefault(c.fqn, []).append(c)
    return out


def _check_against_reference(index: Index, md: Metadata, chunks: list[Chunk], external: dict) -> None:
    expected = _expected(chunks)
    assert list(index.tensors) == list(expected)
    ends: dict[str, int] = {}
    for c in chunks:
        if c.base is None:
            ends[c.path] = max(ends.get(c.path, 0), c.pos + sum(c.lens))
    assert {(f.base, f.path): f.size for f in index.files} == {
        **{(None, p): e for p, e in ends.items()}, **{k: f.size for k, f in external.items()}
    }
    for fqn, want in expected.items():
        t = index.tensors[fqn]
        smd = md.state_dict_metadata[fqn]
        assert t.dtype == smd.properties.dtype and t.shape == tuple(smd.size)
        assert t.offsets.shape == t.sizes.shape == (len(want), len(smd.size))
        assert [tuple(o) for o in t.offsets.tolist()] == [c.offsets for c in want]
        assert [tuple(s) for s in t.sizes.tolist()] == [c.sizes for c in want]
        assert [(index.files[f].base, index.files[f].path) for f in t.file.tolist()] == [(c.base, c.path) for c in want]
        assert t.pos.tolist() == [c.pos for c in want]
        assert np.diff(t.frame_start).tolist() == [len(c.lens) for c in want]
        assert t.frame_len.tolist() == [n for c in want for n in c.lens]
        assert t.frame_codec.tolist() == [x for c in want for x in c.codecs]
        assert t.frame_hash.tobytes() == b"".join(c.hashes for c in want)
    assert index.values == {"step": msgpack.packb(17)}


def _assert_same(a: Index, b: Index) -> None:
    assert (a.frame_size, a.world_size, a.created, a.files, a.values, a.user) == (
        b.frame_size, b.world_size, b.created, b.files, b.values, b.user
    )
    assert list(a.tensors) == list(b.tensors)
    for fqn, ta in a.tensors.items():
        tb = b.tensors[fqn]
        assert (ta.dtype, ta.shape) == (tb.dtype, tb.shape)
        for name in ("offsets", "sizes", "file", "pos", "frame_start", "frame_len", "frame_codec", "frame_hash"):
            x, y = getattr(ta, name), getattr(tb, name)
            assert x.shape == y.shape and np.array_equal(x, y), (fqn, name)


def test_round_trip_of_mixed_layouts_matches_the_reference():
    md, results, chunks, external = _simulate(64, 50)
    assert all(sum(type(wr.storage_data) is RankChunks for wr in r) == 1 for r in results)
    built = build_index(md, results, frame_size=FRAME, files=external, user={"step": 7})
    _check_against_reference(built, md, chunks, external)
    data = encode_index(built)
    decoded = decode_index(data, source="test")
    _assert_same(built, decoded)
    _check_against_reference(decoded, md, chunks, external)
    assert decoded.world_size == 64 and decoded.user == {"step": 7}

    meta = decoded.to_metadata()
    expected = _expected(chunks)
    assert list(meta.state_dict_metadata) == [*expected, "step"]
    assert isinstance(meta.state_dict_metadata["step"], BytesStorageMetadata)
    for fqn, want in expected.items():
        tmd = meta.state_dict_metadata[fqn]
        assert tmd.size == md.state_dict_metadata[fqn].size and tmd.properties.dtype == md.state_dict_metadata[fqn].properties.dtype
        assert tmd.chunks == [ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)) for c in want]
        assert all(type(c.offsets) is torch.Size and type(c.sizes) is torch.Size for c in tmd.chunks)


def test_a_single_rank_with_one_frame_per_chunk_takes_the_unsorted_path():
    """One rank writing its tensors in order: the grouping needs no reordering."""
    md, results, chunks, external = _simulate(8, 10, seed=3)
    one = [[wr for r in results for wr in r]]  # every chunk from one "rank", in tensor-major order
    assert build_index(md, one, frame_size=FRAME, files=external).world_size == 1
    by_tensor = sorted(chunks, key=lambda c: list(_expected(chunks)).index(c.fqn))
    records = [
        (MetadataIndex(c.fqn, torch.Size(c.offsets)),
         StoredChunk(c.path, c.pos, c.sizes, np.array(c.lens, "<i8").tobytes(), bytes(c.codecs), c.hashes, c.base))
        for c in by_tensor
    ]
    values = [wr for r in results for wr in r if isinstance(wr.storage_data, StoredValue)]
    index = build_index(md, [[*values, WriteResult(MetadataIndex("<rank>"), 0, RankChunks.pack(records))]],
                        frame_size=FRAME, files=external)
    _check_against_reference(index, md, by_tensor, external)
    _assert_same(index, decode_index(encode_index(index)))


def test_benchmark_simulation_round_trips_into_dcp_chunks():
    md, results, _ = simulate(64, 50)
    index = decode_index(encode_index(build_index(md, results, frame_size=4 << 20)))
    full = _metadata(64, 50, chunks=True)
    meta = index.to_metadata()
    assert list(meta.state_dict_metadata) == list(full.state_dict_metadata)
    for fqn, want in full.state_dict_metadata.items():
        assert meta.state_dict_metadata[fqn].chunks == want.chunks
        assert meta.state_dict_metadata[fqn].size == want.size
    # Tensors with the same layout share their offsets' torch.Size objects, not their chunks.
    a, b = meta.state_dict_metadata["model.layers.0.w0.weight"], meta.state_dict_metadata["model.layers.0.w1.weight"]
    assert a.chunks[5].offsets is b.chunks[5].offsets and a.chunks[5] is not b.chunks[5]


def test_encoding_is_canonical_msgpack_and_the_hash_covers_every_byte():
    md, results, _, external = _simulate(16, 10)
    data = encode_index(build_index(md, results, frame_size=FRAME, files=external))
    doc = msgpack.unpackb(data, raw=False)
    assert list(doc)[-1] == "index_hash"
    assert msgpack.packb(doc, use_bin_type=True) == data  # re-encoding gives the same bytes
    hashed = dict(doc)
    del hashed["index_hash"]
    from shardstore.codec import frame_hash

    assert doc["index_hash"] == frame_hash(msgpack.packb(hashed, use_bin_type=True))
    for i in (len(data) // 3, len(data) // 2, len(data) - 17):  # a bin column, mid-document, the digest
        damaged = bytearray(data)
        damaged[i] ^= 0x10
        with pytest.raises(InvalidCheckpointError):
            decode_index(bytes(damaged), source="idx")
    moved = {"index_hash": doc["index_hash"], **hashed}  # a valid digest, but not the last entry
    with pytest.raises(InvalidCheckpointError, match="idx: index checksum mismatch"):
        decode_index(msgpack.packb(moved, use_bin_type=True), source="idx")


def _one_rank(**changes: Any) -> tuple[Metadata, list[list[WriteResult]]]:
    md, results, _, _ = _simulate(8, 5)
    rc = next(wr.storage_data for wr in results[2] if isinstance(wr.storage_data, RankChunks))
    bad = dataclasses.replace(rc, **changes) if changes else rc
    results[2] = [WriteResult(MetadataIndex("<rank>"), 0, bad)]
    return md, results


@pytest.mark.parametrize(
    "changes, message",
    [
        (lambda rc: {"fqn": np.full(len(rc), 99, "<i4").tobytes()}, "rank 2 name a tensor outside their table"),
        (lambda rc: {"file": np.full(len(rc), -1, "<i4").tobytes()}, "rank 2 name a data file outside their table"),
        (lambda rc: {"nframes": rc.nframes[:-4]}, "rank 2 have .* bytes of chunk column 'nframes'"),
        (lambda rc: {"pos": rc.pos + b"x"}, "rank 2 have .* bytes of chunk column 'pos'"),
        (lambda rc: {"frame_hash": rc.frame_hash + b"x"}, "rank 2 have .* bytes of chunk column 'frame_hash'"),
        (lambda rc: {"fqns": msgpack.packb(["nope", *rc.names()[1:]])}, "hold tensor 'nope', which has no tensor metadata"),
        (lambda rc: {"fqns": msgpack.packb([1, 2])}, "name their tensors with something other than a list of str"),
        (lambda rc: {"fqns": b"\xc1"}, "name their tensors in invalid msgpack"),
    ],
    ids=["tensor-id", "file-id", "short-column", "partial-item", "long-column", "unknown-tensor", "names-type",
         "names-garbage"],
)
def test_inconsistent_write_results_are_refused_when_building(changes, message):
    md, results = _one_rank()
    rc = results[2][0].storage_data
    results[2] = [WriteResult(MetadataIndex("<rank>"), 0, dataclasses.replace(rc, **changes(rc)))]
    with pytest.raises(InvalidCheckpointError, match=message):
        build_index(md, results, frame_size=FRAME)


def test_a_chunk_per_write_result_is_refused():
    md, results = _one_rank()
    results[0].append(WriteResult(MetadataIndex("layers.0.w0"), 0, StoredChunk("f", 0, (1,), b"", b"", b"")))
    with pytest.raises(InvalidCheckpointError, match="unexpected write result for layers.0.w0: StoredChunk"):
        build_index(md, results, frame_size=FRAME)


class _Recording(ShardWriter):
    def finish(self, metadata, results):
        self.results = results
        super().finish(metadata, results)


def test_shard_writer_sends_one_packed_result_per_rank(tmp_path):
    state = {"a": torch.arange(3000, dtype=torch.float32), "b": torch.ones(4, 5, dtype=torch.bfloat16), "step": 5}
    writer = _Recording(str(tmp_path / "c"), threads=2, frame_size=4096)
    dcp.save(state, storage_writer=writer)
    (rank_results,) = writer.results
    packed = [wr.storage_data for wr in rank_results if isinstance(wr.storage_data, RankChunks)]
    assert len(packed) == 1 and len(rank_results) == 2  # the tensors' chunks, and the value
    assert sorted(packed[0].names()) == ["a", "b"] and len(packed[0]) == 2
    assert len(packed[0].files) == 2 and all(base is None for base, _ in packed[0].files)
    assert writer.bytes_written == sum(wr.size_in_bytes for wr in rank_results)
    index = ShardReader(str(tmp_path / "c")).index
    assert np.diff(index.tensors["a"].frame_start).tolist() == [3]  # 12,000 bytes in 4 KiB frames
    out = {"a": torch.zeros(3000), "b": torch.zeros(4, 5, dtype=torch.bfloat16), "step": 0}
    dcp.load(out, storage_reader=ShardReader(str(tmp_path / "c")))
    assert torch.equal(out["a"], state["a"]) and torch.equal(out["b"], state["b"]) and out["step"] == 5
