"""Benchmark of the index at scale: build, encode, decode and ``to_metadata`` for many ranks.

The index is the commit record: the coordinator builds it from every rank's write results in
``ShardWriter.finish`` and every rank parses it before a load, so its cost grows with ranks x
tensors and sits on the critical path of both. This benchmark feeds ``build_index`` simulated
write results in the shape ``ShardWriter.write_data`` returns them (one packed
:class:`~shardstore.index.RankChunks` per rank, FSDP2-like: every tensor sharded on dim 0 over
all ranks, one frame per chunk) and times each stage, next to what DCP does for the same
checkpoint: ``FileSystemWriter.finish`` (the ``storage_data`` map from every chunk's
``WriteResult``, then pickling ``.metadata``) and ``FileSystemReader.read_metadata`` (unpickling
it). It also times the gather of write results that DCP runs between ``write_data`` and
``finish`` (``gather_object``: each rank pickles its list, the coordinator unpickles them all),
for shardstore's packed results and DCP's ``WriteResult`` per chunk.

Target (issue 2): 4,096 ranks x 500 tensors built and parsed in under 5 s.
"""

from __future__ import annotations

import gc
import logging
import pickle
import time
from typing import Any

import msgpack
import numpy as np
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.storage import WriteResult

from benchmarks.common import bench_main, fmt_bytes, fmt_ratio, fmt_seconds, is_smoke, median, sized
from shardstore.codec import HASH_SIZE
from shardstore.config import WriteOptions
from shardstore.index import RankChunks, build_index, decode_index, encode_index
from shardstore.writer import RANK_CHUNKS_FQN

logger = logging.getLogger(__name__)

#: Chunk shapes (rows per rank, columns) cycled over the tensors, like the few distinct shapes
#: that repeat layer after layer in a transformer (attention, MLP up/down, a small projection).
CHUNK_SHAPES = [(16, 1024), (16, 1024), (44, 1024), (16, 2816), (4, 1024)]
DTYPE = torch.bfloat16


def _fqn(t: int) -> str:
    return f"model.layers.{t // len(CHUNK_SHAPES)}.w{t % len(CHUNK_SHAPES)}.weight"


def _shapes(ntensors: int) -> np.ndarray:
    """[ntensors, 2] chunk shape of each tensor."""
    return np.array([CHUNK_SHAPES[t % len(CHUNK_SHAPES)] for t in range(ntensors)], dtype=np.int64)


def _metadata(ranks: int, ntensors: int, *, chunks: bool) -> Metadata:
    """DCP's global ``Metadata`` for the simulated checkpoint, with or without its chunk lists.

    ``build_index`` reads only dtypes and global shapes from it, so the shardstore side is given
    the light form (DCP's planner builds the chunk lists on both sides; that is not timed).
    """
    props = TensorProperties(dtype=DTYPE)
    md: dict[str, Any] = {}
    for t, (rows, cols) in enumerate(_shapes(ntensors).tolist()):
        size = torch.Size((ranks * rows, cols))
        chunk_list = []
        if chunks:
            sizes = torch.Size((rows, cols))
            chunk_list = [ChunkStorageMetadata(torch.Size((r * rows, 0)), sizes) for r in range(ranks)]
        md[_fqn(t)] = TensorStorageMetadata(properties=props, size=size, chunks=chunk_list)
    return Metadata(state_dict_metadata=md)


def _rank_results(rank: int, ntensors: int, fqns: bytes, rng: np.random.Generator) -> list[WriteResult]:
    """What ``ShardWriter.write_data`` returns on ``rank``: one write result, its chunks packed."""
    frame_size = WriteOptions().frame_size
    shapes = _shapes(ntensors)
    nbytes = shapes.prod(axis=1) * DTYPE.itemsize
    if (nbytes > frame_size).any():
        raise ValueError("the simulation assumes one frame per chunk")
    offsets = np.zeros_like(shapes)
    offsets[:, 0] = rank * shapes[:, 0]
    pos = np.zeros(ntensors, dtype=np.int64)
    np.cumsum(nbytes[:-1], out=pos[1:])  # every size is a multiple of the 64-byte record alignment
    chunks = RankChunks(
        fqns=fqns,
        files=((None, f"data-0123456789ab-r{rank:05d}-00.bin"),),
        fqn=np.arange(ntensors, dtype="<i4").tobytes(),
        offsets=offsets.astype("<i8").tobytes(),
        sizes=shapes.astype("<i8").tobytes(),
        file=np.zeros(ntensors, dtype="<i4").tobytes(),
        pos=pos.astype("<i8").tobytes(),
        nframes=np.ones(ntensors, dtype="<i4").tobytes(),
        frame_len=nbytes.astype("<i8").tobytes(),
        frame_codec=bytes(ntensors),
        frame_hash=rng.bytes(ntensors * HASH_SIZE),
    )
    return [WriteResult(index=MetadataIndex(RANK_CHUNKS_FQN, index=rank), size_in_bytes=int(nbytes.sum()),
                        storage_data=chunks)]


def simulate(ranks: int, ntensors: int) -> tuple[Metadata, list[list[WriteResult]], list[bytes]]:
    """Fake the inputs of ``ShardWriter.finish`` for ``ranks`` x ``ntensors`` shards.

    Returns:
        DCP's global ``Metadata`` (dtypes and shapes; no chunk lists, which ``build_index`` does
        not read), the write results per rank as the coordinator receives them (each rank's list
        pickled and unpickled, as DCP's ``gather_object`` does), and each rank's pickled list.
    """
    rng = np.random.default_rng(0)
    fqns = msgpack.packb([_fqn(t) for t in range(ntensors)])
    pickled = [pickle.dumps(_rank_results(r, ntensors, fqns, rng)) for r in range(ranks)]
    return _metadata(ranks, ntensors, chunks=False), [pickle.loads(p) for p in pickled], pickled


def simulate_dcp(ranks: int, ntensors: int) -> tuple[Metadata, list[list[WriteResult]]]:
    """DCP's side of the same checkpoint: the global ``Metadata`` with every chunk, and
    ``FileSystemWriter``'s write results (a ``WriteResult`` with a ``_StorageInfo`` per chunk)."""
    shapes = _shapes(ntensors)
    nbytes = (shapes.prod(axis=1) * DTYPE.itemsize).tolist()
    pos = np.concatenate(([0], np.cumsum(nbytes[:-1]))).tolist()
    rows = shapes[:, 0].tolist()
    fqns = [_fqn(t) for t in range(ntensors)]
    was = gc.isenabled()
    gc.disable()  # millions of acyclic objects; DCP's own unpickle makes them without collections too
    try:
        results = [
            [
                WriteResult(
                    index=MetadataIndex(fqns[t], torch.Size((r * rows[t], 0)), r),
                    size_in_bytes=nbytes[t],
                    storage_data=_StorageInfo(relative_path=f"__{r}_0.distcp", offset=pos[t], length=nbytes[t]),
                )
                for t in range(ntensors)
            ]
            for r in range(ranks)
        ]
        return _metadata(ranks, ntensors, chunks=True), results
    finally:
        if was:
            gc.enable()


def _time_gather(results: list[list[WriteResult]], pickled: list[bytes] | None = None) -> dict[str, Any]:
    """DCP's ``gather_object`` of the write results on its critical path: one rank pickles its list
    (every rank does so at once) and the coordinator unpickles every rank's list."""
    t0 = time.perf_counter()
    pickle.dumps(results[0])
    t1 = time.perf_counter()
    blobs = pickled if pickled is not None else [pickle.dumps(r) for r in results]  # the other ranks, untimed
    gc.collect()
    t2 = time.perf_counter()
    back = [pickle.loads(b) for b in blobs]
    t3 = time.perf_counter()
    if len(back) != len(results):
        raise RuntimeError("gather round trip lost ranks")
    return {"seconds": (t1 - t0) + (t3 - t2), "size": sum(map(len, blobs))}


def _time_shardstore(md: Metadata, results: list[list[WriteResult]]) -> dict[str, Any]:
    frame_size = WriteOptions().frame_size
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    index = build_index(md, results, frame_size=frame_size)
    t1 = time.perf_counter()
    data = encode_index(index)
    t2 = time.perf_counter()
    decoded = decode_index(data, source="bench")
    t3 = time.perf_counter()
    meta = decoded.to_metadata()
    t4 = time.perf_counter()
    nchunks = sum(len(v.chunks) for v in meta.state_dict_metadata.values())
    expected = sum(len(wr.storage_data) for r in results for wr in r)
    if nchunks != expected:
        raise RuntimeError(f"to_metadata returned {nchunks} chunks, expected {expected}")
    out.update(build=t1 - t0, encode=t2 - t1, decode=t3 - t2, to_metadata=t4 - t3, size=len(data))
    out["total"] = t4 - t0
    return out


def _time_dcp(md: Metadata, results: list[list[WriteResult]]) -> dict[str, Any]:
    # FileSystemWriter.finish: metadata.storage_data = {MetadataIndex: _StorageInfo}; pickle.dump.
    t0 = time.perf_counter()
    storage: dict[MetadataIndex, Any] = {}
    for wr_list in results:
        storage.update({wr.index: wr.storage_data for wr in wr_list})
    full = Metadata(state_dict_metadata=md.state_dict_metadata, storage_data=storage)
    t1 = time.perf_counter()
    data = pickle.dumps(full)
    t2 = time.perf_counter()
    back = pickle.loads(data)  # FileSystemReader.read_metadata
    t3 = time.perf_counter()
    if len(back.storage_data) != len(storage):
        raise RuntimeError("DCP metadata round trip lost storage entries")
    return {"build": t1 - t0, "encode": t2 - t1, "decode": t3 - t2, "size": len(data), "total": t3 - t0}


def run(quick: bool) -> dict[str, Any]:
    """Index build/encode/decode/to_metadata time and size from 16 to 4,096 simulated ranks."""
    ntensors = sized(quick, full=500, quick_size=500, smoke=10)
    scales = sized(quick, full=[16, 64, 256, 1024, 4096], quick_size=[16, 256, 4096], smoke=[4, 16])
    # DCP's side is millions of Python objects at 4,096 ranks (pickling them alone takes minutes on
    # a 2-core machine), so --quick measures it up to 256 ranks; the full run measures every scale.
    dcp_scales = sized(quick, full=scales, quick_size=[16, 256], smoke=[4, 16])
    reps = sized(quick, full=1, quick_size=1, smoke=1)
    rows = []
    last: dict[str, Any] = {}
    for ranks in scales:
        md, results, pickled = simulate(ranks, ntensors)
        dmd = dresults = None
        ss: list[dict[str, Any]] = []
        dc: list[dict[str, Any]] = []
        for i in range(reps):
            # Alternate which side goes first; collect garbage outside the timed region. DCP's
            # millions of objects are made after shardstore's first run, so that its collections
            # do not walk them (with one repetition, neither side times the other's garbage).
            order = ["shardstore", "dcp"] if ranks in dcp_scales else ["shardstore"]
            for side in order if i % 2 == 0 else order[::-1]:
                if side == "dcp" and dresults is None:
                    dmd, dresults = simulate_dcp(ranks, ntensors)
                gc.collect()
                if side == "dcp":
                    dc.append(_time_dcp(dmd, dresults))
                else:
                    ss.append(_time_shardstore(md, results))
        s = {k: median([x[k] for x in ss]) for k in ss[0]}
        gc.collect()
        g = _time_gather(results, pickled)
        row = [
            ranks, ntensors, f"{ranks * ntensors:,}",
            fmt_seconds(s["build"]), fmt_seconds(s["encode"]), fmt_seconds(s["decode"]), fmt_seconds(s["to_metadata"]),
            fmt_seconds(s["total"]), fmt_bytes(s["size"]),
        ]
        d: dict[str, Any] | None = None
        dg: dict[str, Any] | None = None
        if dresults is not None:
            d = {k: median([x[k] for x in dc]) for k in dc[0]}
            gc.collect()
            dg = _time_gather(dresults)
            row += [
                fmt_seconds(d["build"]), fmt_seconds(d["encode"]), fmt_seconds(d["decode"]), fmt_seconds(d["total"]),
                fmt_bytes(d["size"]), fmt_ratio(d["total"] / s["total"]), fmt_ratio(d["size"] / s["size"]),
            ]
        else:
            row += ["—"] * 7
        row += [fmt_seconds(g["seconds"]), fmt_bytes(g["size"])]
        row += [fmt_seconds(dg["seconds"]), fmt_bytes(dg["size"]), fmt_ratio(dg["seconds"] / g["seconds"])] if dg else ["—"] * 3
        rows.append(row)
        last = {"ranks": ranks, "total": s["total"], "dcp": d["total"] if d else None}
        del md, results, pickled, dmd, dresults
        gc.collect()
    notes = [
        f"Simulated FSDP2 write results: every tensor sharded on dim 0 over all ranks (bf16 chunks of "
        f"{len(set(CHUNK_SHAPES))} shapes cycled over the tensors, one frame each), one data file per rank. "
        "Building the fake results is not timed.",
        f"Median of {reps} repetition(s), shardstore and DCP alternated. shardstore total = build + encode + "
        "decode + to_metadata (the coordinator's finish plus a rank's read_metadata).",
        "DCP total = build (FileSystemWriter.finish's storage_data map from every chunk's WriteResult) + pickle "
        "(.metadata) + unpickle (FileSystemReader.read_metadata). DCP's planner builds the Metadata chunk "
        "lists itself on both sides; that is not timed.",
        "gather: what DCP's gather_object costs between write_data and finish on its critical path, one rank's "
        "pickle.dumps of its write results plus the coordinator's pickle.loads of every rank's (sizes: all "
        "ranks' pickles together). shardstore ranks send one packed RankChunks each, DCP's FileSystemWriter a "
        "WriteResult per chunk.",
        "to_metadata shares torch.Size objects between tensors whose offsets tables are equal (tensors of one "
        "shape, as in the layers of a model); a checkpoint whose every tensor has its own layout pays for one "
        "torch.Size per chunk offset instead.",
        "size ratio > 1: the shardstore index is smaller than DCP's .metadata, although it also holds a "
        "16-byte checksum, codec and length per frame.",
    ]
    if len(dcp_scales) < len(scales):
        notes.append(f"--quick: DCP measured at {', '.join(map(str, dcp_scales))} ranks only ('—').")
    if not is_smoke() and last["ranks"] == 4096 and ntensors == 500:
        verdict = "meets" if last["total"] < 5 else "MISSES"
        notes.append(f"4,096 ranks x 500 tensors: {fmt_seconds(last['total'])} in total, {verdict} the < 5 s target.")
    dcp_last = last["dcp"]
    summary = [[
        f"index {last['ranks']} ranks x {ntensors} tensors, build+parse", rows[-1][7],
        f"{fmt_seconds(dcp_last)} (storage map + pickle + unpickle)" if dcp_last else "— (not measured in --quick)",
        fmt_ratio(dcp_last / last["total"]) if dcp_last else "—",
    ]]
    return {
        "title": "Index at scale: build, encode, decode, to_metadata (shardstore) vs pickled .metadata (DCP)",
        "columns": ["ranks", "tensors", "chunks", "build", "encode", "decode", "to_metadata", "total", "index size",
                    "DCP build", "DCP pickle", "DCP unpickle", "DCP total", "DCP .metadata size",
                    "total DCP / shardstore", "size DCP / shardstore",
                    "gather", "gathered", "DCP gather", "DCP gathered", "gather DCP / shardstore"],
        "rows": rows,
        "notes": notes,
        "plot": {"x": "ranks", "y": ["build", "encode", "decode", "to_metadata", "total", "DCP total", "gather",
                                     "DCP gather"],
                 "kind": "line",
                 "ylabel": "seconds", "logx": True, "logy": True},
        "summary": summary,
    }


if __name__ == "__main__":
    bench_main(run)
