"""Benchmark of resharded loads: a checkpoint saved on N ranks loaded on M (2->4, 4->3, 4->1).

Jobs resume on a different number of GPUs after a preemption, so a resharded load is a normal
load, not an edge case. DCP's load planner maps each target shard to the saved chunks that
overlap it (the same for both readers); what differs is the storage layer: DCP's
``FileSystemReader`` reads the whole saved chunk for every read item that overlaps it and
narrows afterwards, so a rank that needs half of a chunk still reads all of it, while
``ShardReader`` reads only the frames that hold the requested rows. This benchmark measures the
time (cold page cache, slowest rank) and the data bytes read by all ranks, and checks every load
against the saved values with a world-size-independent checksum.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from benchmarks.common import (
    MiB,
    alternate,
    bench_dir,
    bench_main,
    collective_time,
    combine_checksums,
    counting_dcp_reader,
    evict,
    fmt_bytes,
    fmt_rate,
    fmt_ratio,
    fmt_seconds,
    layout_bytes,
    make_sharded_state,
    median,
    run_ranks,
    shard_checksum,
    sized,
)
from benchmarks.bench_core import DTYPES, ntensors
from shardstore import ShardReader, ShardWriter

logger = logging.getLogger(__name__)



def rank_save(path: str, kind: str, total: int, frame_size: int | None = None) -> dict[str, int]:
    """On every rank: save the benchmark state (not timed); return this rank's checksums."""
    state = make_sharded_state(total, DTYPES, ntensors(total), seed=1, cache=True)
    if kind == "shardstore":
        writer = ShardWriter(path, **({"frame_size": frame_size} if frame_size else {}))
    else:
        writer = FileSystemWriter(path, sync_files=True)
    dcp.save(state, storage_writer=writer)
    return shard_checksum(state)


def rank_load(path: str, kind: str, total: int) -> dict[str, Any]:
    """On every rank: load into zeroed shards; return seconds, bytes read and checksums."""
    state = make_sharded_state(total, DTYPES, ntensors(total), empty=True, cache=True)
    for v in state.values():
        v.to_local().zero_()
    readers: list[Any] = []

    def load() -> None:
        reader = ShardReader(path) if kind == "shardstore" else counting_dcp_reader(path)
        readers.append(reader)
        dcp.load(state, storage_reader=reader)

    seconds, _ = collective_time(load)
    return {"seconds": seconds, "bytes_read": readers[0].bytes_read, "checksum": shard_checksum(state)}


def _frame_sweep(root: str, total: int, src: int, dst: int, frame_sizes: list[int], reps: int,
                 saved: dict[str, int]) -> dict[str, Any]:
    """Amplification and time of one resharded load against the frame size the checkpoint used."""
    nbytes = layout_bytes(total, DTYPES, ntensors(total))
    paths = {"dcp": os.path.join(root, f"dcp-{src}")}
    for fs in frame_sizes:
        paths[fs] = os.path.join(root, f"shardstore-{src}-fs{fs}")
        if combine_checksums(run_ranks(src, rank_save, paths[fs], "shardstore", total, frame_size=fs)) != saved:
            raise RuntimeError(f"the {src}-rank state saved with frame_size {fs} differs")
    counted: dict[Any, int] = {}

    def load(key: Any) -> float:
        kind = "dcp" if key == "dcp" else "shardstore"
        evict(paths[key])
        results = run_ranks(dst, rank_load, paths[key], kind, total)
        if combine_checksums([r["checksum"] for r in results]) != saved:
            raise RuntimeError(f"{key}: the {src} -> {dst} rank load does not match the saved values")
        counted[key] = sum(r["bytes_read"] for r in results)
        return max(r["seconds"] for r in results)

    times = alternate({str(k): (lambda k=k: load(k)) for k in paths}, reps=reps)
    t_dcp = median(times["dcp"])
    chunk = nbytes / ntensors(total) / src
    rows = []
    for key in [*frame_sizes, "dcp"]:
        t = median(times[str(key)])
        label = "DCP FileSystemReader" if key == "dcp" else f"shardstore, frame_size {fmt_bytes(key)}"
        rows.append([label, f"{counted[key] / nbytes:.3f}", fmt_seconds(t), fmt_ratio(t_dcp / t)])
    return {
        "title": f"Resharded load {src} -> {dst}: read amplification against frame size "
                 f"(saved chunks of {fmt_bytes(chunk)})",
        "columns": ["reader", "amplification", "time", "speedup vs DCP"],
        "rows": rows,
        "notes": [
            "A frame is shardstore's unit of checksum (and compression): a partial read must fetch whole frames "
            "to verify them, so a target shard boundary that falls inside a frame reads that frame twice (once "
            "per rank), and a saved chunk of one frame is read whole by every rank that needs part of it.",
            f"Same state as above ({ntensors(total)} tensors, {fmt_bytes(nbytes)}); median of {reps} alternated "
            "repetition(s), cold cache.",
        ],
        "plot": {"x": "reader", "y": ["amplification"], "kind": "bar", "ylabel": "bytes read / checkpoint bytes"},
    }


def run(quick: bool) -> list[dict[str, Any]]:
    """Resharded loads 2->4, 4->3, 4->1: time and bytes read, ShardReader vs FileSystemReader."""
    total = sized(quick, full=1024 * MiB, quick_size=256 * MiB, smoke=2 * MiB)
    reps = sized(quick, full=3, quick_size=2, smoke=1)
    # The smoke test stays within 2 rank processes: spawning more costs more than the whole test.
    cases = sized(quick, full=[(2, 4), (4, 3), (4, 1)], quick_size=[(2, 4), (4, 3), (4, 1)], smoke=[(1, 2), (2, 1)])
    frame_sizes = sized(quick, full=[4 * MiB, 1 * MiB, 256 * 1024], quick_size=[4 * MiB, 1 * MiB, 256 * 1024],
                        smoke=[4 * MiB, 16 * 1024])
    nbytes = layout_bytes(total, DTYPES, ntensors(total))
    rows = []
    summary = []
    with bench_dir("reshard") as root:
        saved: dict[int, dict[str, int]] = {}
        for src in sorted({s for s, _ in cases}):
            for kind in ("shardstore", "dcp"):
                sums = combine_checksums(run_ranks(src, rank_save, os.path.join(root, f"{kind}-{src}"), kind, total))
                if saved.setdefault(src, sums) != sums:
                    raise RuntimeError(f"the {src}-rank states saved for shardstore and DCP differ")
        for src, dst in cases:
            counted: dict[str, list[int]] = {"shardstore": [], "dcp": []}

            def load(kind: str, src: int = src, dst: int = dst, counted: dict[str, list[int]] = counted) -> float:
                path = os.path.join(root, f"{kind}-{src}")
                evict(path)
                results = run_ranks(dst, rank_load, path, kind, total)
                if combine_checksums([r["checksum"] for r in results]) != saved[src]:
                    raise RuntimeError(f"{kind}: the {src} -> {dst} rank load does not match the saved values")
                counted[kind].append(sum(r["bytes_read"] for r in results))
                return max(r["seconds"] for r in results)

            times = alternate({"shardstore": lambda: load("shardstore"), "dcp": lambda: load("dcp")}, reps=reps)
            t_ss, t_dcp = median(times["shardstore"]), median(times["dcp"])
            b_ss, b_dcp = counted["shardstore"][-1], counted["dcp"][-1]
            rows.append([
                f"{src} -> {dst}", fmt_seconds(t_ss), fmt_seconds(t_dcp), fmt_ratio(t_dcp / t_ss),
                fmt_rate(nbytes, t_ss), fmt_rate(nbytes, t_dcp),
                fmt_bytes(b_ss), f"{b_ss / nbytes:.3f}", fmt_bytes(b_dcp), f"{b_dcp / nbytes:.3f}",
            ])
            summary.append([f"resharded load {src}->{dst} (cold)", fmt_seconds(t_ss), fmt_seconds(t_dcp),
                            fmt_ratio(t_dcp / t_ss)])
        sweep = _frame_sweep(root, total, *cases[0], frame_sizes, reps, saved[cases[0][0]])
    main = {
        "title": f"Resharded loads: {fmt_bytes(nbytes)} of bf16/fp32 DTensor shards, cold cache",
        "columns": ["ranks", "shardstore", "DCP", "speedup", "shardstore rate", "DCP rate",
                    "shardstore read", "shardstore amplification", "DCP read", "DCP amplification"],
        "rows": rows,
        "notes": [
            f"Median of {reps} alternated repetition(s); time of the slowest rank between barriers, page cache of "
            "the checkpoint evicted before each load. speedup > 1: shardstore is faster.",
            "read / amplification: data bytes read by all ranks (ShardReader.bytes_read; DCP counted at its file "
            "streams) and that divided by the checkpoint's tensor bytes.",
            "Every load is checked against the saved state with a position-weighted checksum summed over ranks.",
            f"This machine has {os.cpu_count()} CPU cores; 3 and 4 ranks share them.",
        ],
        "plot": {"x": "ranks", "y": ["shardstore amplification", "DCP amplification"], "kind": "bar",
                 "ylabel": "bytes read / checkpoint bytes"},
        "summary": summary,
    }
    return [main, sweep]


if __name__ == "__main__":
    bench_main(run)
