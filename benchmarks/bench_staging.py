"""Benchmark of async-save staging: the copy of the state into host memory that blocks the caller.

An async save blocks training only while the state is copied to host memory
(:mod:`shardstore.staging`); this measures that copy on its own, in one process, against what
DCP's own stager does for ``dcp.async_save`` (``_create_cpu_state_dict`` + ``_copy_state_dict``,
pinned for GPU state, as its ``DefaultStager`` does with ``cache_staged_state_dict``) and against
the limit of the link: one flat copy of the same bytes (GPU -> pinned host on a GPU machine,
``memcpy`` on CPU). On a machine with CUDA the state lives on the GPU; without one it is CPU
state and the copy is a host memcpy.

Rows: the first call (allocates, and pins, the host buffers) and later calls of the same
structure (the buffers are reused), shardstore and DCP alternated, medians.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any

import torch
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

from benchmarks.common import MiB, bench_main, fmt_bytes, fmt_rate, fmt_ratio, fmt_seconds, median, sized
from shardstore.staging import StagingBuffers

logger = logging.getLogger(__name__)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _state(total: int, device: str, ntensors: int = 64) -> dict[str, torch.Tensor]:
    """``ntensors`` bf16 tensors of 1,024 columns, ``total`` bytes together, on ``device``."""
    rows = max(1, total // ntensors // (1024 * 2))
    g = torch.Generator(device=device).manual_seed(0)
    return {f"layer{i}.weight": torch.randn(rows, 1024, device=device, generator=g).bfloat16() for i in range(ntensors)}


def _time(fn: Any, device: str) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def run(quick: bool) -> dict[str, Any]:
    """Blocking time of staging a state into host memory: shardstore vs DCP's stager vs the link."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    total = sized(quick, full=8192 * MiB, quick_size=1024 * MiB, smoke=8 * MiB)
    reps = sized(quick, full=5, quick_size=3, smoke=1)
    state = _state(total, device)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    pin = device == "cuda"

    # The link's limit: one flat copy of the same number of bytes into (pinned) host memory.
    flat = torch.full((nbytes,), 7, dtype=torch.uint8, device=device)  # touched: no zero-page reads
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    host.copy_(flat, non_blocking=pin)  # first touch
    _sync(device)
    limit = median([_time(lambda: host.copy_(flat, non_blocking=pin), device) for _ in range(reps)])
    flat = host = None  # free both before the state is staged

    ours: dict[str, list[float]] = {"first": [], "steady": []}
    theirs: dict[str, list[float]] = {"first": [], "steady": []}

    def shardstore_round() -> None:
        buffers = StagingBuffers()
        box: list[Any] = []
        ours["first"].append(_time(lambda: box.append(buffers.stage(state)), device))
        for k, t in state.items():  # checked outside the timed region
            if box[0][k].data_ptr() == t.data_ptr() or not torch.equal(box[0][k], t.cpu()):
                raise RuntimeError(f"shardstore staged {k} wrong")
        box.clear()
        ours["steady"].append(median([_time(lambda: buffers.stage(state), device) for _ in range(reps)]))
        buffers.release()

    def dcp_round() -> None:
        box: list[Any] = []

        def first() -> None:
            cpu = _create_cpu_state_dict(state, pin_memory=pin)
            _copy_state_dict(state, cpu, non_blocking=pin)  # fills ``cpu``; returns the source
            box.append(cpu)

        theirs["first"].append(_time(first, device))
        for k, t in state.items():
            if box[0][k].data_ptr() == t.data_ptr() or not torch.equal(box[0][k], t.cpu()):
                raise RuntimeError(f"DCP staged {k} wrong")
        cpu = box.pop()
        theirs["steady"].append(median([_time(lambda: _copy_state_dict(state, cpu, non_blocking=pin), device)
                                        for _ in range(reps)]))
        cpu = None  # drop the copy before the next round

    for i in range(sized(quick, full=3, quick_size=2, smoke=1)):
        for fn in (shardstore_round, dcp_round) if i % 2 == 0 else (dcp_round, shardstore_round):
            gc.collect()
            fn()

    rows = []
    for phase, label in (("first", "first call (allocate, pin, copy)"), ("steady", "later calls (buffers reused)")):
        s, d = median(ours[phase]), median(theirs[phase])
        rows.append([label, fmt_seconds(s), fmt_rate(nbytes, s), fmt_seconds(d), fmt_rate(nbytes, d),
                     fmt_ratio(d / s), fmt_rate(nbytes, limit), fmt_ratio(limit / s)])
    link = "GPU -> pinned host copy" if device == "cuda" else "host memcpy"
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    return {
        "title": f"Async-save staging on {name}: blocking copy of {fmt_bytes(nbytes)} into host memory",
        "columns": ["call", "shardstore", "shardstore rate", "DCP stager", "DCP rate", "DCP / shardstore time",
                    "limit rate", "shardstore / limit"],
        "rows": rows,
        "notes": [
            f"State: 64 bf16 tensors on {device}, {fmt_bytes(nbytes)}; one process. shardstore: "
            "StagingBuffers.stage (one pinned arena, side-stream copies). DCP: _create_cpu_state_dict"
            f"(pin_memory={pin}) + _copy_state_dict(non_blocking={pin}), what its stager does for dcp.async_save.",
            f"Limit: one flat {link} of the same bytes. Time ratios > 1: shardstore blocks for less time.",
            f"Medians over {reps} later calls and alternated rounds; staged copies are checked against the state.",
            "First call on a GPU: DCP's pinned tensors come from CUDA's caching host allocator "
            "(Tensor.pin_memory()), which keeps freed pinned blocks, so its first calls after the first round "
            "reuse memory pinned earlier in this process; shardstore registers a fresh arena each round "
            "(cudaHostRegister, no power-of-two rounding) and unpins it on release.",
        ],
        "summary": [[f"staging {fmt_bytes(nbytes)} ({device}), later calls", rows[1][1], rows[1][3], rows[1][5]]],
    }


if __name__ == "__main__":
    bench_main(run)
