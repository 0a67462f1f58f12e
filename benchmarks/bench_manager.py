"""Benchmark of the CheckpointManager's overhead: listing, lease check, commit, retention.

Issue 6's question: what does the manager cost per step over a bare ``ShardWriter`` save of the
same small state? A training loop saving a small state often (a fine-tuning job, a tiny model,
a frequent "latest" checkpoint) pays this overhead every time, so it must stay small next to
the save itself.

Three cases, each saving the same state at steps 1..N into a fresh root, alternated A/B/C over
repetitions, medians reported per step:

* **bare ShardWriter**: ``dcp.save(state, storage_writer=ShardWriter(<root>/step-N))``, nothing
  else (no listing, no retention: the root grows). The floor.
* **CheckpointManager(keep_last=3)**: ``mgr.save(N, state)``; its lease check before each
  commit, retention after each commit (a listing of the root, reading the new index, deleting the
  step that falls out), and ``wait()`` for the last background retention inside the timing.
* **DCP + hand-rolled keep_last=3**: ``dcp.save`` with DCP's ``FileSystemWriter`` (local) or
  ``FsspecWriter`` (S3), then list the root and delete the steps beyond the last 3, as training
  scripts do it by hand today (torchtitan's ``keep_latest_k``). The DCP baseline.

Stores: the local disk (durable saves: fsync on both sides) and, unless smoke mode, the S3 test
server (moto in its own process, ``benchmarks.bench_s3.moto_server``), where the request counts
per step (from moto's request log) show what the manager adds.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from benchmarks.common import (
    MiB,
    alternate,
    bench_dir,
    bench_main,
    fmt_bytes,
    fmt_ratio,
    is_smoke,
    make_state,
    median,
    sized,
    state_bytes,
)
from shardstore import ShardWriter
from shardstore.backends import open_backend
from shardstore.manager import CheckpointManager, step_name

logger = logging.getLogger(__name__)

KEEP = 3
NTENSORS = 16
CASES = ("bare", "manager", "dcp")
LABELS = {
    "bare": "bare ShardWriter (no retention)",
    "manager": f"CheckpointManager(keep_last={KEEP})",
    "dcp": f"DCP + hand-rolled keep_last={KEEP}",
}

warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)


def _state(nbytes: int) -> dict[str, Any]:
    return {"model": make_state(nbytes, "float32", NTENSORS), "extra": {"step": 0, "epoch": 1}}


# --------------------------------------------------------------------------- the three loops


def _bare(root: str, state: dict[str, Any], steps: int, so: dict[str, Any] | None) -> None:
    backend = open_backend(root, so)
    try:
        for step in range(1, steps + 1):
            state["extra"]["step"] = step
            dcp.save(state, storage_writer=ShardWriter(backend.child(step_name(step))), no_dist=True)
    finally:
        backend.close()


def _managed(root: str, state: dict[str, Any], steps: int, so: dict[str, Any] | None) -> None:
    with CheckpointManager(root, keep_last=KEEP, storage_options=so) as mgr:
        for step in range(1, steps + 1):
            state["extra"]["step"] = step
            mgr.save(step, state)
        mgr.wait()


def _dcp_local(root: str, state: dict[str, Any], steps: int) -> None:
    os.makedirs(root, exist_ok=True)
    for step in range(1, steps + 1):
        state["extra"]["step"] = step
        dcp.save(state, storage_writer=FileSystemWriter(os.path.join(root, step_name(step))), no_dist=True)
        for old in sorted(os.listdir(root))[:-KEEP]:
            shutil.rmtree(os.path.join(root, old))


def _dcp_s3(url: str, state: dict[str, Any], steps: int, so: dict[str, Any]) -> None:
    import fsspec.core
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    fs, root = fsspec.core.url_to_fs(url, **so)
    for step in range(1, steps + 1):
        state["extra"]["step"] = step
        dcp.save(state, storage_writer=FsspecWriter(f"{url}/{step_name(step)}", **so), no_dist=True)
        fs.invalidate_cache(root)
        for old in sorted(fs.ls(root, detail=False))[:-KEEP]:
            fs.rm(old, recursive=True)


# --------------------------------------------------------------------------- driver


def _measure(
    loops: dict[str, Callable[[str], None]], new_root: Callable[[str], str], cleanup: Callable[[str], None],
    steps: int, reps: int, count: Callable[[], int] | None,
) -> tuple[dict[str, float], dict[str, float]]:
    """Per-step median seconds of each loop (alternated), and per-step requests when counted."""
    requests: dict[str, list[float]] = {name: [] for name in loops}

    def case(name: str) -> Callable[[], float]:
        def run_once() -> float:
            root = new_root(name)
            if count is not None:
                count()  # traffic before the case is not its own
            t0 = time.perf_counter()
            loops[name](root)
            seconds = time.perf_counter() - t0
            if count is not None:
                requests[name].append(count() / steps)
            cleanup(root)
            return seconds / steps

        return run_once

    times = alternate({name: case(name) for name in loops}, reps=reps, warmup=1 if not is_smoke() else 0)
    per_step = {name: median(ts) for name, ts in times.items()}
    per_req = {name: median(rs[-reps:]) for name, rs in requests.items() if rs}
    return per_step, per_req


def _rows(store: str, per_step: dict[str, float], per_req: dict[str, float]) -> tuple[list[list[Any]], list[Any]]:
    bare, mgr, base = per_step["bare"], per_step["manager"], per_step["dcp"]
    rows = []
    for name in CASES:
        t = per_step[name]
        rows.append([
            store,
            LABELS[name],
            f"{t * 1e3:.1f} ms",
            f"{(t - bare) * 1e3:+.1f} ms" if name != "bare" else "-",
            fmt_ratio(t / bare),
            fmt_ratio(base / t),
            f"{per_req[name]:.1f}" if name in per_req else "-",
        ])
    logger.info("%s: manager %.1f ms/step, bare %.1f ms/step, dcp %.1f ms/step", store, mgr * 1e3, bare * 1e3, base * 1e3)
    summary = [f"save + keep_last={KEEP} per step ({store})", f"{mgr * 1e3:.1f} ms", f"{base * 1e3:.1f} ms", fmt_ratio(base / mgr)]
    return rows, summary


def _local(state: dict[str, Any], steps: int, reps: int) -> tuple[list[list[Any]], list[Any]]:
    with bench_dir("manager") as d:
        counter = iter(range(1 << 30))
        loops = {
            "bare": lambda root: _bare(root, state, steps, None),
            "manager": lambda root: _managed(root, state, steps, None),
            "dcp": lambda root: _dcp_local(root, state, steps),
        }
        per_step, _ = _measure(
            loops, lambda name: os.path.join(d, f"{name}-{next(counter)}"),
            lambda root: shutil.rmtree(root, ignore_errors=True), steps, reps, None,
        )
    return _rows("local disk", per_step, {})


def _s3(state: dict[str, Any], steps: int, reps: int) -> tuple[list[list[Any]], list[Any]]:
    from benchmarks.bench_s3 import BUCKET, moto_server

    with bench_dir("manager-s3") as d, moto_server(d) as server:
        so = server.storage_options
        counter = iter(range(1 << 30))
        loops = {
            "bare": lambda root: _bare(root, state, steps, so),
            "manager": lambda root: _managed(root, state, steps, so),
            "dcp": lambda root: _dcp_s3(root, state, steps, so),
        }

        def cleanup(url: str) -> None:
            backend = open_backend(url, so)
            try:
                backend.delete(backend.list())
            finally:
                backend.close()

        per_step, per_req = _measure(
            loops, lambda name: f"s3://{BUCKET}/{name}-{next(counter)}", cleanup, steps, reps,
            lambda: sum(server.cut().values()),
        )
    return _rows("S3 (moto)", per_step, per_req)


def run(quick: bool) -> dict[str, Any]:
    """Per-step overhead of CheckpointManager over a bare ShardWriter save, and vs DCP by hand."""
    nbytes = sized(quick, full=4 * MiB, quick_size=2 * MiB, smoke=256 << 10)
    steps = sized(quick, full=100, quick_size=20, smoke=6)
    reps = sized(quick, full=3, quick_size=2, smoke=1)
    s3_steps = sized(quick, full=50, quick_size=5, smoke=0)
    s3_reps = sized(quick, full=2, quick_size=1, smoke=1)
    state = _state(nbytes)
    rows, first = _local(state, steps, reps)
    summary = [first]
    if s3_steps:
        more, second = _s3(state, s3_steps, s3_reps)
        rows += more
        summary.append(second)
    return {
        "title": f"CheckpointManager overhead: {steps} steps of a {fmt_bytes(state_bytes(state['model']))} state, one process",
        "columns": ["store", "case", "per step", "vs bare", "time / bare", "DCP by hand / case", "requests / step"],
        "rows": rows,
        "notes": [
            "Each case saves steps 1..N into a fresh root; cases alternate, medians over repetitions; per step = total / N.",
            "'vs bare' is the manager's (or the hand-rolled DCP loop's) extra time per step over a bare ShardWriter save.",
            "Manager work per step, after the commit and in the background (waited for at the end): a LIST of the new "
            f"step, a read of its index, and deleting the step that falls out of keep_last={KEEP} (index, then data). "
            "The lease is checked from its heartbeat times, without a request.",
            "Local saves are durable on every side (ShardWriter fsyncs; FileSystemWriter(sync_files=True)).",
            f"S3 rows ({s3_steps} steps) run against moto on loopback, a CPU-bound server sharing this machine, so "
            "they measure request count more than latency; requests are counted from its log.",
        ],
        "summary": summary,
    }


if __name__ == "__main__":
    bench_main(run)
