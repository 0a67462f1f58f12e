"""Benchmark of save/load throughput against state size (issue 9, scenario 1).

How does each way of checkpointing scale from a small model to a large one? On 2 ranks, states
of bf16/fp32 DTensor shards from 256 MiB to 4 GiB are saved durably and loaded from a cold page
cache with ``ShardWriter`` (raw and zstd), DCP's ``FileSystemWriter(sync_files=True)`` /
``FileSystemReader``, and ``torch.save``/``torch.load`` of the whole state in one process; the
dd write limit is measured at each size in the same alternation. Rates above the dd limit are
possible only where fewer bytes reach the disk (zstd).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch

from benchmarks.bench_core import DTYPES, ntensors, rank_load, rank_save
from benchmarks.common import (
    GiB,
    MiB,
    alternate,
    bench_dir,
    bench_main,
    clear_state_cache,
    dir_bytes,
    disk_write_limit,
    evict,
    fmt_bytes,
    fmt_rate,
    fmt_ratio,
    fresh_dir,
    layout_bytes,
    make_state,
    median,
    run_ranks,
    sized,
)

logger = logging.getLogger(__name__)

WORLD = 2
KINDS = ("shardstore", "shardstore-zstd", "dcp")


def _one_size(root: str, total: int, reps: int) -> tuple[list[list[Any]], dict[str, tuple[str, str, float]]]:
    nbytes = layout_bytes(total, DTYPES, ntensors(total))
    paths = {k: os.path.join(root, k) for k in (*KINDS, "torch")}
    full = make_state(total, DTYPES, ntensors(total))
    tfile = os.path.join(paths["torch"], "model.pt")

    def torch_save() -> None:
        os.makedirs(fresh_dir(paths["torch"]))
        with open(tfile, "wb") as f:
            torch.save(full, f)
            f.flush()
            os.fsync(f.fileno())

    def dist_save(kind: str) -> float:
        return max(run_ranks(WORLD, rank_save, fresh_dir(paths[kind]), kind, total))

    cases: dict[str, Any] = {k: (lambda k=k: dist_save(k)) for k in KINDS}
    cases["torch.save"] = torch_save
    cases["dd"] = lambda: nbytes / disk_write_limit(root, nbytes)
    saves = alternate(cases, reps=reps)
    stored = {k: dir_bytes(paths[k]) for k in KINDS}
    full.clear()  # free the gathered copy before the loads

    def dist_load(kind: str) -> float:
        evict(paths[kind])
        results = run_ranks(WORLD, rank_load, paths[kind], kind, total, check_seed=0)
        if not all(r["equal"] for r in results):
            raise RuntimeError(f"{kind}: the {fmt_bytes(nbytes)} load did not return the saved values")
        return max(r["seconds"] for r in results)

    def torch_load() -> float:
        evict(tfile)
        t0 = time.perf_counter()
        loaded = torch.load(tfile, weights_only=True)
        seconds = time.perf_counter() - t0
        del loaded
        return seconds

    lcases: dict[str, Any] = {k: (lambda k=k: dist_load(k)) for k in KINDS}
    lcases["torch.load"] = torch_load
    loads = alternate(lcases, reps=reps)
    run_ranks(WORLD, clear_state_cache)
    for p in paths.values():
        fresh_dir(p)

    s = {k: median(v) for k, v in saves.items()}
    l = {k: median(v) for k, v in loads.items()}
    size = fmt_bytes(nbytes)
    rows = [
        [f"{size} save", fmt_rate(nbytes, s["shardstore"]), fmt_rate(nbytes, s["shardstore-zstd"]),
         fmt_rate(nbytes, s["dcp"]), fmt_rate(nbytes, s["torch.save"]), fmt_rate(nbytes, s["dd"]),
         fmt_ratio(s["dcp"] / s["shardstore"]), fmt_ratio(s["dcp"] / s["shardstore-zstd"]),
         f"{nbytes / stored['shardstore-zstd']:.3f}"],
        [f"{size} load (cold)", fmt_rate(nbytes, l["shardstore"]), fmt_rate(nbytes, l["shardstore-zstd"]),
         fmt_rate(nbytes, l["dcp"]), fmt_rate(nbytes, l["torch.load"]), "-",
         fmt_ratio(l["dcp"] / l["shardstore"]), fmt_ratio(l["dcp"] / l["shardstore-zstd"]), "-"],
    ]
    return rows, {"save": (rows[0][1], rows[0][3], s["dcp"] / s["shardstore"]),
                  "load": (rows[1][1], rows[1][3], l["dcp"] / l["shardstore"])}


def run(quick: bool) -> dict[str, Any]:
    """Save/load throughput from 256 MiB to 4 GiB on 2 ranks: shardstore raw/zstd vs DCP vs torch.save."""
    sizes = sized(quick, full=[256 * MiB, 1 * GiB, 4 * GiB], quick_size=[64 * MiB, 256 * MiB], smoke=[1 * MiB])
    reps = sized(quick, full=2, quick_size=2, smoke=1)
    rows: list[list[Any]] = []
    ratios: dict[str, dict[str, tuple[str, str, float]]] = {}
    with bench_dir("throughput") as root:
        for total in sizes:
            r, ratio = _one_size(root, total, reps)
            rows.extend(r)
            ratios[fmt_bytes(layout_bytes(total, DTYPES, ntensors(total)))] = ratio
    largest = list(ratios)[-1]
    return {
        "title": f"Throughput vs state size: {WORLD} ranks, bf16/fp32 DTensor shards, durable saves, cold loads",
        "columns": ["case", "shardstore", "shardstore zstd", "DCP FileSystem", "torch.save/load (1 proc)",
                    "disk limit (dd)", "shardstore / DCP", "zstd / DCP", "zstd ratio"],
        "rows": rows,
        "notes": [
            f"Medians of {reps} alternated repetitions; rate = state bytes / seconds of the slowest rank. "
            "Ratios > 1: shardstore is faster than DCP.",
            "zstd ratio = raw bytes / stored bytes (level 1; random normal weights compress little, mostly the "
            "exponent bytes).",
            "torch.save/load: one process holding the whole state (gathering not timed), fsync after the save.",
        ],
        "plot": [
            {"x": "case", "y": ["shardstore", "shardstore zstd", "DCP FileSystem", "torch.save/load (1 proc)"],
             "kind": "bar", "ylabel": "GB/s (saves then loads per size)"},
        ],
        "summary": [
            [f"save {largest}, 2 ranks, durable", *ratios[largest]["save"][:2], fmt_ratio(ratios[largest]["save"][2])],
            [f"load {largest}, 2 ranks, cold", *ratios[largest]["load"][:2], fmt_ratio(ratios[largest]["load"][2])],
        ],
    }


if __name__ == "__main__":
    bench_main(run)
