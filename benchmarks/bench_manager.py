"""Benchmark of the CheckpointManager's overhead: listing, lease check, commit, retention.

Issue 6's question: what does the manager cost per step over a bare ``ShardWriter`` save of the
same small state? A training loop saving a small state often (a fine-tuning job, a tiny model,
a frequent "latest" checkpoint) pays this overhead every time, so it must stay small next to
the save itself.

Four cases, each saving the same state at steps 1..N into its own fresh root, run in lockstep
(step k of each case, in an order rotated at every step, so the shared machine's load drifts hit
all alike), medians of the per-step times reported:

* **bare ShardWriter**: ``dcp.save(state, storage_writer=ShardWriter(<root>/step-N))``, nothing
  else (no listing, no retention: the root grows). The floor.
* **CheckpointManager() / CheckpointManager(keep_last=3)**: ``mgr.save(N, state)`` then
  ``mgr.wait()``, so the work that normally runs in the background after the commit (a listing
  of the new step; with ``keep_last``, deleting the step that falls out) is inside each step's
  time. The first shows the bookkeeping alone, the second adds the deletions.
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

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from benchmarks.common import (
    MiB,
    bench_dir,
    bench_main,
    fmt_bytes,
    fmt_ratio,
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
CASES = ("bare", "keepall", "manager", "dcp")
LABELS = {
    "bare": "bare ShardWriter (no retention)",
    "keepall": "CheckpointManager() (no retention)",
    "manager": f"CheckpointManager(keep_last={KEEP})",
    "dcp": f"DCP + hand-rolled keep_last={KEEP}",
}

warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)


def _state(nbytes: int) -> dict[str, Any]:
    return {"model": make_state(nbytes, "float32", NTENSORS), "extra": {"step": 0, "epoch": 1}}


# --------------------------------------------------------------------------- the cases


class _Bare:
    """``dcp.save`` with a ShardWriter per step into ``<root>/step-N``; nothing else."""

    def __init__(self, root: str, so: dict[str, Any] | None) -> None:
        self.backend = open_backend(root, so)

    def save(self, step: int, state: dict[str, Any]) -> None:
        dcp.save(state, storage_writer=ShardWriter(self.backend.child(step_name(step))), no_dist=True)

    def close(self) -> None:
        self.backend.close()


class _Managed:
    """``CheckpointManager.save`` and then ``wait()``, so its background retention is counted."""

    keep_last: int | None = KEEP

    def __init__(self, root: str, so: dict[str, Any] | None) -> None:
        self.mgr = CheckpointManager(root, keep_last=self.keep_last, storage_options=so)

    def save(self, step: int, state: dict[str, Any]) -> None:
        self.mgr.save(step, state)
        self.mgr.wait()

    def close(self) -> None:
        self.mgr.close()


class _KeepAll(_Managed):
    """The manager's bookkeeping alone: lease, commit, gc's listing, nothing to delete."""

    keep_last = None


class _HandRolled:
    """DCP's own writer, then list the root and delete the steps beyond the last ``KEEP``."""

    def __init__(self, root: str, so: dict[str, Any] | None) -> None:
        import fsspec.core

        self.root, self.so = root, so
        self.fs, self.path = fsspec.core.url_to_fs(root, **(so or {}))
        self.local = so is None
        if self.local:
            os.makedirs(root, exist_ok=True)

    def save(self, step: int, state: dict[str, Any]) -> None:
        if self.local:
            writer: Any = FileSystemWriter(os.path.join(self.root, step_name(step)))
        else:
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

            writer = FsspecWriter(f"{self.root}/{step_name(step)}", **(self.so or {}))
        dcp.save(state, storage_writer=writer, no_dist=True)
        if self.local:
            for old in sorted(os.listdir(self.root))[:-KEEP]:
                shutil.rmtree(os.path.join(self.root, old))
            return
        self.fs.invalidate_cache(self.path)
        for old in sorted(self.fs.ls(self.path, detail=False))[:-KEEP]:
            self.fs.rm(old, recursive=True)

    def close(self) -> None:
        pass


CLASSES = {"bare": _Bare, "keepall": _KeepAll, "manager": _Managed, "dcp": _HandRolled}


# --------------------------------------------------------------------------- driver


def _measure(
    state: dict[str, Any], new_root: Callable[[str], str], cleanup: Callable[[str], None], so: dict[str, Any] | None,
    steps: int, reps: int, count: Callable[[], int] | None,
) -> tuple[dict[str, float], dict[str, float]]:
    """Median seconds (and requests) per step of each case, excluding each run's first step.

    The cases run in lockstep, step by step, in an order rotated at every step, so that the
    machine's load drifts hit all of them alike; the first step (lease, connections) is left out.
    """
    times: dict[str, list[float]] = {name: [] for name in CASES}
    requests: dict[str, list[float]] = {name: [] for name in CASES}
    for _ in range(reps):
        roots = {name: new_root(name) for name in CASES}
        cases = {name: CLASSES[name](roots[name], so) for name in CASES}
        try:
            for step in range(1, steps + 1):
                state["extra"]["step"] = step
                k = step % len(CASES)
                for name in CASES[k:] + CASES[:k]:
                    if count is not None:
                        count()  # traffic before this step is not its own
                    t0 = time.perf_counter()
                    cases[name].save(step, state)
                    seconds = time.perf_counter() - t0
                    if step > 1:
                        times[name].append(seconds)
                        if count is not None:
                            requests[name].append(count())
        finally:
            for name, case in cases.items():
                case.close()
                cleanup(roots[name])
    return {n: median(t) for n, t in times.items()}, {n: median(r) for n, r in requests.items() if r}


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
            f"{per_req[name]:.0f}" if name in per_req else "-",
        ])
    logger.info("%s: manager %.1f ms/step, bare %.1f ms/step, dcp %.1f ms/step", store, mgr * 1e3, bare * 1e3,
                base * 1e3)
    summary = [f"save + keep_last={KEEP} per step ({store})", f"{mgr * 1e3:.1f} ms", f"{base * 1e3:.1f} ms",
               fmt_ratio(base / mgr)]
    return rows, summary


def _local(state: dict[str, Any], steps: int, reps: int) -> tuple[list[list[Any]], list[Any]]:
    with bench_dir("manager") as d:
        counter = iter(range(1 << 30))
        per_step, _ = _measure(
            state, lambda name: os.path.join(d, f"{name}-{next(counter)}"),
            lambda root: shutil.rmtree(root, ignore_errors=True), None, steps, reps, None,
        )
    return _rows("local disk", per_step, {})


def _s3(state: dict[str, Any], steps: int, reps: int) -> tuple[list[list[Any]], list[Any]]:
    from benchmarks.bench_s3 import BUCKET, moto_server

    with bench_dir("manager-s3") as d, moto_server(d) as server:
        so = server.storage_options
        counter = iter(range(1 << 30))

        def cleanup(url: str) -> None:
            backend = open_backend(url, so)
            try:
                backend.delete(backend.list())
            finally:
                backend.close()

        per_step, per_req = _measure(
            state, lambda name: f"s3://{BUCKET}/{name}-{next(counter)}", cleanup, so, steps, reps,
            lambda: sum(server.cut().values()),
        )
    return _rows("S3 (moto)", per_step, per_req)


def run(quick: bool) -> dict[str, Any]:
    """Per-step overhead of CheckpointManager over a bare ShardWriter save, and vs DCP by hand."""
    nbytes = sized(quick, full=4 * MiB, quick_size=2 * MiB, smoke=256 << 10)
    steps = sized(quick, full=100, quick_size=40, smoke=6)
    reps = sized(quick, full=2, quick_size=1, smoke=1)
    s3_steps = sized(quick, full=100, quick_size=15, smoke=0)
    s3_reps = 1
    state = _state(nbytes)
    size = fmt_bytes(state_bytes(state["model"]))
    rows, first = _local(state, steps, reps)
    summary = [first]
    if s3_steps:
        more, second = _s3(state, s3_steps, s3_reps)
        rows += more
        summary.append(second)
    return {
        "title": f"CheckpointManager overhead: {steps} steps of a {size} state, one process",
        "columns": ["store", "case", "per step", "vs bare", "time / bare", "DCP by hand / case", "requests / step"],
        "rows": rows,
        "notes": [
            "The cases save steps 1..N into fresh roots in lockstep (order rotated every step); per step = median "
            "over all steps but each run's first (lease, connections).",
            "'vs bare' is a case's extra time per step over a bare ShardWriter save.",
            "The manager cases call wait() after every save, so the background work after each commit is inside the "
            f"timing: a LIST of the new step and, with keep_last={KEEP}, deleting the step that falls out (its index, "
            "then its data files). The files a step references come from the save's own write results, and the lease "
            "is checked from its heartbeat times: neither costs a request.",
            "Local saves are durable on every side (ShardWriter fsyncs; FileSystemWriter(sync_files=True)).",
        ] + ([
            f"S3 rows ({s3_steps} steps) run against moto on loopback, a CPU-bound server sharing this machine, so "
            "they measure request count more than latency; requests are counted from its log.",
        ] if s3_steps else []),
        "summary": summary,
    }


if __name__ == "__main__":
    bench_main(run)
