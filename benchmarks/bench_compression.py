"""Benchmark of compression and checksums (issue 3): stored size, durable save/load, hash cost.

One process saves weights (random normal, std 0.02: the scale of initialised layers) of bf16 and
of fp32 with ``ShardWriter`` uncompressed and with ``compression="zstd"`` (byte-grouped frames),
and with DCP's ``FileSystemWriter(sync_files=True)`` as the baseline; every save is durable
(fsync of files and directory), next to the disk's own ``dd ... conv=fdatasync`` rate. Loads are
cold (the checkpoint's pages evicted first) and checked equal to what was saved. The checksum's
cost is an uncompressed durable save with XXH3-128 per frame against the same save with the hash
replaced by a constant (patched in this process only), and, steadier on a shared machine, the
time to hash the same bytes alone relative to the save. ``shardstore verify`` speed is shown too.

Rates are raw (logical) bytes per second, so a compressed save that writes fewer bytes shows up
as faster. Targets: bf16 stored <= 0.72 of raw, fp32 <= 0.88; durable zstd save >= 1.2x the
uncompressed one; zstd load >= 0.8x; checksum <= 5% of an uncompressed save.

No package on this machine ships trained weights (searched the package lists), so only random
normal weights are measured; trained weights have a narrower exponent distribution in most
layers and usually compress a little better.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

import shardstore.codec
from benchmarks.common import (
    MiB,
    alternate,
    bench_dir,
    bench_main,
    dir_bytes,
    disk_write_limit,
    evict,
    fmt_bytes,
    fmt_rate,
    fmt_ratio,
    fresh_dir,
    is_smoke,
    make_state,
    median,
    read_limit,
    sized,
)
from shardstore import ShardReader, ShardWriter
from shardstore.verify import verify_checkpoint

logger = logging.getLogger(__name__)

NTENSORS = 16
FRAME = 4 * MiB  # ShardWriter's default frame size
TARGETS = {"bfloat16": 0.72, "float32": 0.88}
SAVE_TARGET, LOAD_TARGET, HASH_TARGET = 1.2, 0.8, 0.05
_NO_HASH = bytes(16)


@contextlib.contextmanager
def _hashing(enabled: bool) -> Iterator[None]:
    """Replace the frame checksum by a constant while measuring a save without it."""
    original = shardstore.codec.frame_hash
    if not enabled:
        shardstore.codec.frame_hash = lambda raw: _NO_HASH
    try:
        yield
    finally:
        shardstore.codec.frame_hash = original


def _save(kind: str, state: dict[str, Any], path: str, *, hashing: bool = True) -> None:
    fresh_dir(path)
    if kind == "dcp":
        writer: Any = FileSystemWriter(path, sync_files=True)
    else:
        writer = ShardWriter(path, compression="zstd" if kind == "zstd" else None, sync=True)
    with _hashing(hashing):
        dcp.save(state, storage_writer=writer, no_dist=True)


def _load(kind: str, target: dict[str, Any], path: str) -> None:
    reader: Any = FileSystemReader(path) if kind == "dcp" else ShardReader(path)
    dcp.load(target, storage_reader=reader, no_dist=True)


def _target_cell(value: float, target: float, *, at_most: bool, percent: bool = False) -> str:
    ok = value <= target if at_most else value >= target
    sign = "<=" if at_most else ">="
    shown = f"{target * 100:.0f} %" if percent else f"{target:.2f}"
    return f"{sign} {shown} ({'met' if ok else 'missed'})"


def _cpu_rates(state: dict[str, Any], dtype: str) -> dict[str, float]:
    """Bytes per CPU-second of one thread for hashing, byte-grouped zstd encode and decode.

    Measured with ``time.thread_time`` (CPU time of this thread), so time spent waiting for a
    core on a busy machine does not count: these are what one free core does.
    """
    codec = shardstore.codec.choose_codec("zstd", True, torch.empty((), dtype=getattr(torch, dtype)).element_size())
    frames = [
        memoryview(t.reshape(-1).view(torch.uint8).numpy())[i : i + FRAME]
        for t in state.values()
        for i in range(0, t.numel() * t.element_size(), FRAME)
    ]
    raw = sum(f.nbytes for f in frames)
    t0 = time.thread_time()
    for f in frames:
        xxhash.xxh3_128_digest(f)
    t1 = time.thread_time()
    encoded = [shardstore.codec.encode_frame(f, codec, level=1, min_saving=0.03) for f in frames]
    t2 = time.thread_time()
    for (stored, used, _), f in zip(encoded, frames):
        shardstore.codec.decode_frame(stored, used, f.nbytes)
    t3 = time.thread_time()
    return {"hash": raw / (t1 - t0), "encode": raw / (t2 - t1), "decode": raw / (t3 - t2)}


def _one_dtype(root: str, dtype: str, total: int, reps: int) -> dict[str, Any]:
    state = make_state(total, dtype, NTENSORS)
    raw = sum(t.numel() * t.element_size() for t in state.values())
    paths = {k: os.path.join(root, f"{dtype}-{k}") for k in ("raw", "zstd", "dcp")}
    if not is_smoke():
        for kind, path in paths.items():  # warm-up save: allocator, thread pools, page cache state
            _save(kind, state, path)

    saves = alternate(
        {
            "raw": lambda: _save("raw", state, paths["raw"]),
            "zstd": lambda: _save("zstd", state, paths["zstd"]),
            "dcp": lambda: _save("dcp", state, paths["dcp"]),
            "dd": lambda: raw / disk_write_limit(root, raw),
        },
        reps=reps,
    )
    stored = {k: dir_bytes(p) / raw for k, p in paths.items()}  # data files and index / metadata

    target = {k: torch.zeros_like(v) for k, v in state.items()}
    checked: list[bool] = []

    def load(kind: str) -> None:
        for t in target.values():
            t.zero_()
        evict(paths[kind])
        t0 = time.perf_counter()
        _load(kind, target, paths[kind])
        seconds = time.perf_counter() - t0
        checked.append(all(torch.equal(target[k], state[k]) for k in state))
        return seconds

    def verify(kind: str) -> float:
        evict(paths[kind])
        report = verify_checkpoint(paths[kind])
        checked.append(report.ok)
        return report.seconds

    loads = alternate(
        {
            "raw": lambda: load("raw"),
            "zstd": lambda: load("zstd"),
            "dcp": lambda: load("dcp"),
            "dd": lambda: raw / read_limit(root, raw, cold=True),
        },
        reps=reps,
    )
    verifies = alternate({"raw": lambda: verify("raw"), "zstd": lambda: verify("zstd")}, reps=reps)
    if not all(checked):
        raise RuntimeError(f"{dtype}: a load did not return the saved weights, or verify found damage")

    hashed = alternate(
        {
            "with": lambda: _save("raw", state, paths["raw"], hashing=True),
            "without": lambda: _save("raw", state, paths["raw"], hashing=False),
        },
        reps=reps,
    )
    cpu = _cpu_rates(state, dtype)
    hash_seconds = raw / cpu["hash"]

    s = {k: median(v) for k, v in saves.items()}
    ld = {k: median(v) for k, v in loads.items()}
    vf = {k: median(v) for k, v in verifies.items()}
    h = {k: median(v) for k, v in hashed.items()}
    save_speedup = s["raw"] / s["zstd"]
    load_ratio = ld["raw"] / ld["zstd"]
    hash_overhead = h["with"] / h["without"] - 1
    hash_share = hash_seconds / s["raw"]
    name = {"bfloat16": "bf16", "float32": "fp32"}[dtype]
    rows = [
        [name, "stored / raw", f"{stored['raw']:.3f}", f"{stored['zstd']:.3f}", f"{stored['dcp']:.3f}", "-",
         f"{stored['zstd']:.3f}", _target_cell(stored["zstd"], TARGETS[dtype], at_most=True)],
        [name, "save, durable", fmt_rate(raw, s["raw"]), fmt_rate(raw, s["zstd"]), fmt_rate(raw, s["dcp"]),
         fmt_rate(raw, s["dd"]), fmt_ratio(save_speedup), _target_cell(save_speedup, SAVE_TARGET, at_most=False)],
        [name, "load, cold", fmt_rate(raw, ld["raw"]), fmt_rate(raw, ld["zstd"]), fmt_rate(raw, ld["dcp"]),
         fmt_rate(raw, ld["dd"]), fmt_ratio(load_ratio), _target_cell(load_ratio, LOAD_TARGET, at_most=False)],
        [name, "verify, cold", fmt_rate(raw, vf["raw"]), fmt_rate(raw, vf["zstd"]), "-", fmt_rate(raw, ld["dd"]),
         fmt_ratio(vf["raw"] / vf["zstd"]), "-"],
    ]
    cores = os.cpu_count() or 1
    ratio = stored["zstd"]
    # On an idle machine with every core encoding, the durable zstd save costs encode + write of the
    # stored bytes (the fsync at the end of each file: no overlap), the uncompressed one the write.
    # (s["dd"] and ld["dd"] are the seconds dd takes to write / read the raw bytes.)
    proj_save = s["dd"] / (raw / (cores * cpu["encode"]) + ratio * s["dd"])
    proj_load = ld["dd"] / (ratio * ld["dd"] + raw / (cores * cpu["decode"]))
    cpu_row = [
        name, f"{cpu['hash'] / 1e9:.2f} GB/s", f"{cpu['encode'] / 1e9:.3f} GB/s", f"{cpu['decode'] / 1e9:.3f} GB/s",
        fmt_ratio(proj_save), fmt_ratio(proj_load),
    ]
    hash_row = [
        name, fmt_rate(raw, h["with"]), fmt_rate(raw, h["without"]), f"{hash_overhead * 100:+.1f} %",
        fmt_rate(raw, hash_seconds), f"{hash_share * 100:.1f} %", _target_cell(hash_share, HASH_TARGET, at_most=True, percent=True),
    ]
    summary = [
        [f"{name} stored/raw (zstd)", f"{stored['zstd']:.3f}", f"{stored['raw']:.3f}",
         fmt_ratio(stored["raw"] / stored["zstd"])],
        [f"{name} durable save, zstd vs uncompressed", fmt_rate(raw, s["zstd"]), fmt_rate(raw, s["raw"]),
         fmt_ratio(save_speedup)],
        [f"{name} cold load, zstd vs uncompressed", fmt_rate(raw, ld["zstd"]), fmt_rate(raw, ld["raw"]),
         fmt_ratio(load_ratio)],
    ]
    return {"rows": rows, "hash_row": hash_row, "cpu_row": cpu_row, "summary": summary, "raw": raw}


def run(quick: bool) -> list[dict[str, Any]]:
    """Compression and checksums: stored/raw, durable save and cold load, checksum cost."""
    total = sized(quick, full=512 * MiB, quick_size=96 * MiB, smoke=2 * MiB)
    reps = sized(quick, full=5, quick_size=3, smoke=1)
    rows, hash_rows, cpu_rows, summary = [], [], [], []
    warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
    with bench_dir("compression") as root:
        for dtype in ("bfloat16", "float32"):
            out = _one_dtype(root, dtype, total, reps)
            rows += out["rows"]
            hash_rows.append(out["hash_row"])
            cpu_rows.append(out["cpu_row"])
            summary += out["summary"]
            nbytes = out["raw"]
    cores = os.cpu_count()
    compression = {
        "title": f"Compression: {fmt_bytes(nbytes)} of bf16 and of fp32 weights (std 0.02), 1 process, local disk",
        "columns": ["weights", "measure", "shardstore uncompressed", "shardstore zstd", "DCP FileSystem",
                    "disk limit (dd)", "zstd vs uncompressed", "target"],
        "rows": rows,
        "notes": [
            f"Medians of {reps} alternated repetitions. Rates are raw bytes / seconds (a compressed checkpoint "
            "that writes fewer bytes shows as faster). 'zstd vs uncompressed' > 1 means zstd is ahead; for "
            "'stored / raw' it is the zstd checkpoint's bytes on disk (data files and index) over raw bytes.",
            "Saves are durable on every side: ShardWriter(sync=True) fsyncs files, directory and index; "
            "FileSystemWriter(sync_files=True); dd conv=fdatasync. Loads evict the checkpoint from the page "
            "cache first (cold) and were checked equal to the saved weights; dd reads a fresh file cold.",
            f"zstd level 1 on byte-grouped frames of 4 MiB, {cores} CPU cores. Only the sign/exponent plane "
            "shrinks (to ~0.37); mantissa planes are stored raw. So fp32 (1 of 4 planes compressible) can at "
            "best write ~0.84 of the bytes: its durable save can gain at most 1/0.84 = 1.19x even with free "
            "compression, below the 1.2x target; bf16 (1 of 2 planes) can gain up to ~1.45x when zstd keeps "
            "up with the disk.",
            "A save writes into the page cache and fsyncs each file at its end, so encoding and the disk do "
            "not overlap for checkpoints smaller than the kernel's dirty-writeback threshold: the zstd save "
            "costs encode time + stored bytes / disk rate, the uncompressed one raw bytes / disk rate.",
            "verify reads every frame and checks its XXH3-128 (and decodes zstd frames); its 'disk limit' is "
            "the cold dd read.",
        ],
        "summary": summary,
    }
    checksum = {
        "title": "Checksum cost: uncompressed durable save with and without XXH3-128 per frame",
        "columns": ["weights", "save with hash", "save without hash", "difference", "XXH3-128 (1 core)",
                    "hash time / save time", "target"],
        "rows": hash_rows,
        "notes": [
            "'save without hash' replaces shardstore.codec.frame_hash with a constant in this process only. "
            "On a shared, busy machine the difference of two durable saves is within the noise; 'hash time / "
            "save time' (CPU seconds of one thread to hash the same bytes in 4 MiB frames, over the median "
            "uncompressed save) is the steadier measure of the cost, and an upper bound: the writer hashes a "
            "frame while the previous ones sit in the page cache.",
        ],
    }
    cpu = {
        "title": "CPU cost per core (thread CPU time) and what it implies on an idle machine",
        "columns": ["weights", "XXH3-128", "zstd encode (byte-grouped)", "zstd decode", "projected save speedup",
                    "projected load ratio"],
        "rows": cpu_rows,
        "notes": [
            "Raw bytes per CPU-second of one thread (time.thread_time), single-threaded over every 4 MiB frame "
            "of the state: what one free core does, whatever else the machine runs.",
            f"Projections for an idle machine with all {cores} cores encoding or decoding, with this run's dd rates: "
            "save speedup = (raw / dd write) / (raw / (cores x encode) + stored / dd write); "
            "load ratio = (raw / dd read) / (stored / dd read + raw / (cores x decode)). They assume no overlap "
            "of CPU and disk, as the writer fsyncs each file at its end.",
        ],
    }
    return [compression, checksum, cpu]


if __name__ == "__main__":
    bench_main(run)
