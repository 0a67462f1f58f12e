"""Shared helpers for the benchmark suite: timing, machine limits, rank launch, states, tables.

Benchmarks are how we steer, so every number must be comparable with its baseline. On a shared
machine absolute times are noise; what counts is a ratio measured in the same run, with the two
sides alternated (A B, B A, A B, ...) so that drift in the machine's load hits both equally, and
the median taken. This module holds the pieces every ``benchmarks/bench_*.py`` uses for that.

The contract of a benchmark module ``benchmarks/bench_<name>.py``:

* ``run(quick: bool) -> dict`` returns
  ``{"title": str, "columns": [str, ...], "rows": [[cell, ...], ...], "notes": [str, ...]}``.
  Cells are strings or numbers (format them yourself: :func:`fmt_rate`, :func:`fmt_ratio`,
  :func:`fmt_bytes`, :func:`fmt_seconds`). Optional keys:

  - ``"plot"``: ``{"x": column name, "y": [column names], "kind": "bar" | "line",
    "ylabel": str, "logx": bool, "logy": bool}``; the suite draws a PNG from the table's rows
    (numeric prefixes of cells are parsed, so ``"1.23 GB/s"`` plots as 1.23).
    Or a list of such dicts (one PNG each).
  - ``"summary"``: ``[[scenario, shardstore, baseline, ratio], ...]`` rows that go into the
    report's summary table (ratio > 1 means shardstore is ahead).
  A module with several tables may return a list of such dicts instead.
* ``python -m benchmarks.bench_<name> [--quick]`` prints the table: end the module with
  ``if __name__ == "__main__": bench_main(run)``.
* **Smoke mode**: when the environment has ``SHARDSTORE_BENCH_SMOKE=1`` (see :func:`is_smoke`),
  ``run`` must use tiny sizes, one repetition and at most 2 ranks (spawning more rank processes
  costs more than a whole smoke run) so that it finishes in a few seconds: the test
  ``tests/test_benchmarks_smoke.py`` calls every ``bench_*.run(quick=True)`` this way, all of them
  together within about 40 s. Pick sizes with :func:`sized`, which honours it.
* Do not import from ``tests/``. Multi-rank work goes through :func:`run_ranks`
  (:mod:`shardstore.testing`, re-exported here); the function it runs must be defined at module
  level in the benchmark module.
* Scratch data goes under :func:`bench_dir` (``$SHARDSTORE_BENCH_DIR`` or the system temp dir).

Units: rates are decimal GB/s (1e9 bytes per second), as ``dd`` prints them; sizes are binary
(MiB, GiB).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from shardstore.testing import run_ranks, shutdown_ranks  # the rank pool, for every bench module

logger = logging.getLogger(__name__)

SMOKE_ENV = "SHARDSTORE_BENCH_SMOKE"
DIR_ENV = "SHARDSTORE_BENCH_DIR"
MiB = 1 << 20
GiB = 1 << 30


# --------------------------------------------------------------------------- sizes and modes


def is_smoke() -> bool:
    """True when the benchmark must run at tiny sizes (``SHARDSTORE_BENCH_SMOKE=1``)."""
    return os.environ.get(SMOKE_ENV, "") not in ("", "0")


def sized(quick: bool, *, full: Any, quick_size: Any, smoke: Any) -> Any:
    """Pick a size (or repetition count, or list of sizes) for the current mode.

    Args:
        quick: The ``quick`` argument of ``run``.
        full: Value for a full run.
        quick_size: Value for ``--quick``.
        smoke: Value for the smoke test (``SHARDSTORE_BENCH_SMOKE=1``); wins over both.
    """
    if is_smoke():
        return smoke
    return quick_size if quick else full


@contextlib.contextmanager
def bench_dir(name: str) -> Iterator[str]:
    """A fresh scratch directory for one benchmark, removed afterwards.

    It lives under ``$SHARDSTORE_BENCH_DIR`` (default: the system temp dir), which should be on
    the disk whose speed you want to measure.
    """
    root = os.environ.get(DIR_ENV) or tempfile.gettempdir()
    os.makedirs(root, exist_ok=True)
    path = tempfile.mkdtemp(prefix=f"shardstore-bench-{name}-", dir=root)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def fresh_dir(path: str) -> str:
    """Remove ``path`` if it exists and return it (a save target for one repetition)."""
    if os.path.exists(path):
        shutil.rmtree(path)
    return path


def dir_bytes(path: str) -> int:
    """Total size of the regular files under ``path``."""
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            total += os.path.getsize(os.path.join(root, f))
    return total


# --------------------------------------------------------------------------- timing


def alternate(
    cases: dict[str, Callable[[], float | None]],
    *,
    reps: int,
    warmup: int = 0,
    between: Callable[[], None] | None = None,
) -> dict[str, list[float]]:
    """Time several cases by alternating them, rotating the order every repetition.

    Repetition ``i`` runs the cases in the order rotated by ``i`` (A B C, B C A, C A B, ...), so
    a slow phase of a shared machine hits every case about equally. A case returns the seconds it
    measured itself (e.g. the slowest rank's time of a collective save) or ``None``, in which case
    the wall time of the call is used.

    Args:
        cases: Name to callable.
        reps: Measured repetitions per case.
        warmup: Unmeasured rounds first (each case once per round).
        between: Called before every case (e.g. evict the page cache).

    Returns:
        Name to the list of measured seconds (``reps`` each).
    """
    names = list(cases)
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(warmup + reps):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            if between is not None:
                between()
            t0 = time.perf_counter()
            measured = cases[name]()
            wall = time.perf_counter() - t0
            if i >= warmup:
                times[name].append(wall if measured is None else float(measured))
    return times


def median(values: Sequence[float]) -> float:
    """The median of ``values``."""
    return statistics.median(values)


def time_call(fn: Callable[[], Any], *, reps: int = 3, warmup: int = 0) -> float:
    """Median wall seconds of ``fn()`` over ``reps`` calls."""
    def case() -> None:
        fn()

    return median(alternate({"x": case}, reps=reps, warmup=warmup)["x"])


# --------------------------------------------------------------------------- page cache


def evict(path: str) -> None:
    """Drop ``path``'s pages (a file or every file under a directory) from the page cache.

    Uses ``posix_fadvise(DONTNEED)`` after ``fdatasync``, which needs no privileges and leaves
    other users' caches alone. The next read of these files comes from the disk (cold).
    """
    files = [path] if os.path.isfile(path) else [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def drop_caches() -> bool:
    """Drop the whole page cache (``echo 3 > /proc/sys/vm/drop_caches``); False if not allowed.

    Prefer :func:`evict`: this one also slows down everyone else on a shared machine.
    """
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError as e:
        logger.info("cannot drop the page cache: %s", e)
        return False


def proc_io() -> dict[str, int]:
    """This process's ``/proc/self/io`` counters (all threads): ``rchar``, ``read_bytes``, ...

    ``rchar`` counts bytes passed to read()/pread() (page cache hits included); ``read_bytes``
    counts bytes fetched from the block device (readahead included, cache hits excluded).
    """
    out: dict[str, int] = {}
    with open("/proc/self/io") as f:
        for line in f:
            key, _, value = line.partition(":")
            out[key.strip()] = int(value)
    return out


class _CountingStream:
    """A file object that counts the bytes read through it."""

    def __init__(self, stream: Any, counter: list[int]) -> None:
        self._stream = stream
        self._counter = counter

    def read(self, size: int = -1) -> bytes:
        data = self._stream.read(size)
        self._counter[0] += len(data)
        return data

    def readinto(self, buf: Any) -> int | None:
        n = self._stream.readinto(buf)
        self._counter[0] += n or 0
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def counting_dcp_reader(path: str) -> Any:
    """DCP's ``FileSystemReader`` for ``path``, counting the data bytes it reads.

    The count (``reader.bytes_read``, like :class:`shardstore.ShardReader`'s) covers the data
    files read in ``read_data``, which is where a resharded load's amplification shows; the
    small ``.metadata`` file is not counted (nor is shardstore's index).
    """
    from torch.distributed.checkpoint import FileSystemReader

    class CountingFileSystemReader(FileSystemReader):
        def __init__(self, path: str) -> None:
            super().__init__(path)
            self._counter = [0]
            inner = self.fs

            class _FS:
                def __getattr__(self, name: str) -> Any:
                    return getattr(inner, name)

                @contextlib.contextmanager
                def create_stream(_self, p: Any, mode: str) -> Iterator[Any]:
                    with inner.create_stream(p, mode) as stream:
                        yield _CountingStream(stream, self._counter)

            self.fs = _FS()

        @property
        def bytes_read(self) -> int:
            return self._counter[0]

        def read_data(self, plan: Any, planner: Any) -> Any:
            self._counter[0] = 0
            return super().read_data(plan, planner)

    return CountingFileSystemReader(path)


# --------------------------------------------------------------------------- machine limits


def _dd(args: list[str]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(["dd", *args], capture_output=True, text=True)
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"dd {' '.join(args)} failed: {proc.stderr.strip()}")
    return elapsed


def disk_write_limit(path: str, nbytes: int, *, block: int = 4 * MiB) -> float:
    """Durable write bandwidth in bytes/s: ``dd if=/dev/zero of=<path> bs=4M count=N conv=fdatasync``.

    Args:
        path: A directory on the disk to measure (a temporary file is written and removed).
        nbytes: How much to write (rounded up to whole blocks).
        block: dd block size.
    """
    count = max(1, math.ceil(nbytes / block))
    target = os.path.join(path, f".dd-write-{os.getpid()}")
    try:
        elapsed = _dd(["if=/dev/zero", f"of={target}", f"bs={block}", f"count={count}", "conv=fdatasync"])
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(target)
    return count * block / elapsed


def read_limit(path: str, nbytes: int, *, cold: bool = True, block: int = 4 * MiB) -> float:
    """Sequential read bandwidth in bytes/s of a fresh file of ``nbytes`` under ``path`` (dd).

    Args:
        path: A directory on the disk to measure.
        nbytes: File size (rounded up to whole blocks).
        cold: Evict the file from the page cache first (disk speed); else read it warm (page
            cache speed, what a load right after a save sees).
        block: dd block size.
    """
    count = max(1, math.ceil(nbytes / block))
    target = os.path.join(path, f".dd-read-{os.getpid()}")
    try:
        with open(target, "wb") as f:
            chunk = os.urandom(block)
            for _ in range(count):
                f.write(chunk)
            f.flush()
            os.fdatasync(f.fileno())
        if cold:
            evict(target)
        else:
            _dd([f"if={target}", "of=/dev/null", f"bs={block}"])
        elapsed = _dd([f"if={target}", "of=/dev/null", f"bs={block}"])
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(target)
    return count * block / elapsed


def memcpy_limit(nbytes: int, *, reps: int = 5) -> float:
    """Memory copy bandwidth in bytes/s (``torch`` ``copy_`` of a ``nbytes`` uint8 tensor)."""
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    return nbytes / time_call(lambda: dst.copy_(src), reps=reps)


def cpu_probe() -> float:
    """Seconds for ``sum(range(10**7))`` in this interpreter: how busy the CPUs are right now.

    An idle modern core takes about 0.2 s; a larger value means other processes share the cores,
    which slows every Python-bound stage (index building, planning) by about the same factor.
    """
    return 10 * time_call(lambda: sum(range(10**6)), reps=5)


def machine_limits(path: str, nbytes: int) -> dict[str, float]:
    """The machine's ceilings, in bytes/s: durable write, cold and warm read, memcpy."""
    return {
        "disk_write": disk_write_limit(path, nbytes),
        "read_cold": read_limit(path, nbytes, cold=True),
        "read_warm": read_limit(path, nbytes, cold=False),
        "memcpy": memcpy_limit(min(nbytes, 512 * MiB)),
    }


# --------------------------------------------------------------------------- states


def make_state(
    total_bytes: int,
    dtype: Any = "bfloat16",
    ntensors: int = 16,
    *,
    cols: int = 1024,
    seed: int = 0,
) -> dict[str, Any]:
    """A plain state dict of 2-D weights, random normal with std 0.02 (like initialised layers).

    Args:
        total_bytes: Approximate total size (each tensor gets an equal share, rows rounded to a
            multiple of 12 so that 1, 2, 3 and 4 ranks split it evenly).
        dtype: A torch dtype or its name, or a sequence of them used in turn (e.g.
            ``("bfloat16", "float32")`` for a mixed state).
        ntensors: Number of tensors, named ``layer.<i>.weight``.
        cols: Columns of every tensor.
        seed: Random seed.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    out: dict[str, Any] = {}
    for i, (dt, rows) in enumerate(_layout(total_bytes, dtype, ntensors, cols)):
        out[f"layer.{i}.weight"] = (torch.randn(rows, cols, generator=gen) * 0.02).to(dt)
    return out


def _layout(total_bytes: int, dtype: Any, ntensors: int, cols: int) -> list[tuple[Any, int]]:
    import torch

    dtypes = [dtype] if isinstance(dtype, (str, torch.dtype)) else list(dtype)
    dtypes = [getattr(torch, d) if isinstance(d, str) else d for d in dtypes]
    out = []
    for i in range(ntensors):
        dt = dtypes[i % len(dtypes)]
        per = total_bytes / ntensors / dt.itemsize / cols
        out.append((dt, max(12, int(round(per / 12)) * 12)))
    return out


def make_sharded_state(
    total_bytes: int,
    dtype: Any = "bfloat16",
    ntensors: int = 16,
    *,
    cols: int = 1024,
    seed: int = 0,
    empty: bool = False,
    cache: bool = False,
) -> dict[str, Any]:
    """Like :func:`make_state`, but every tensor is a DTensor sharded on dim 0 over all ranks.

    Call it on every rank of an initialised process group. Each rank only allocates its own
    shard (built with ``DTensor.from_local``, no communication), which is what FSDP2 state looks
    like to DCP. The values of a rank's shard depend on (seed, tensor, rank, world size).

    Args:
        total_bytes: Total size over all ranks.
        dtype: As in :func:`make_state`.
        ntensors: Number of tensors.
        cols: Columns of every tensor.
        seed: Random seed.
        empty: Allocate uninitialised shards (a load target) instead of random values.
        cache: Keep the local shards in this process and reuse them on the next call with the
            same arguments (rank workers live across calls; generating 1 GiB of random numbers
            takes seconds). A load target comes back with the previous load's values in it.
            :func:`clear_state_cache` frees them.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    layout = _layout(total_bytes, dtype, ntensors, cols)
    key = (total_bytes, str(dtype), ntensors, cols, seed, empty, rank, world)
    locals_ = _STATE_CACHE.get(key) if cache else None
    if locals_ is None:
        gen = torch.Generator().manual_seed(seed * 1_000_003 + rank * 7919 + world)
        locals_ = []
        for dt, rows in layout:
            local_rows = _chunk_rows(rows, world, rank)
            if empty:
                locals_.append(torch.empty(local_rows, cols, dtype=dt))
            else:
                locals_.append((torch.randn(local_rows, cols, generator=gen) * 0.02).to(dt))
        if cache:
            _STATE_CACHE[key] = locals_
    out: dict[str, Any] = {}
    for i, ((_, rows), local) in enumerate(zip(layout, locals_)):
        out[f"layer.{i}.weight"] = DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=torch.Size((rows, cols)), stride=(cols, 1)
        )
    return out


_STATE_CACHE: dict[tuple, list[Any]] = {}


def clear_state_cache() -> None:
    """Free the shards kept by ``make_sharded_state(..., cache=True)`` in this process."""
    _STATE_CACHE.clear()


def layout_bytes(total_bytes: int, dtype: Any = "bfloat16", ntensors: int = 16, *, cols: int = 1024) -> int:
    """Exact bytes of the state :func:`make_state` / :func:`make_sharded_state` build."""
    return sum(rows * cols * dt.itemsize for dt, rows in _layout(total_bytes, dtype, ntensors, cols))


def _chunk_rows(rows: int, world: int, rank: int) -> int:
    """Rows of ``rank``'s shard under ``torch.chunk`` semantics (what ``Shard(0)`` uses)."""
    per = -(-rows // world)
    return max(0, min(per, rows - per * rank))


def shard_checksum(state: dict[str, Any]) -> dict[str, int]:
    """Per tensor, a position-weighted integer checksum of this rank's rows of a dim-0 sharded state.

    The bytes of each local shard are read as integers and summed with weight (global row + 1),
    modulo 2**64. Summing the results of all ranks (mod 2**64) gives a value that is independent
    of the world size, so a resharded load can be checked against the save without gathering.
    Works for the states of :func:`make_sharded_state` (and plain tensors, as one shard).
    """
    import torch
    from torch.distributed.tensor import DTensor

    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    out: dict[str, int] = {}
    for fqn, value in state.items():
        row0 = 0
        if isinstance(value, DTensor):
            mesh = value.device_mesh
            world, rank = mesh.size(), mesh.get_local_rank()
            row0 = -(-value.shape[0] // world) * rank
            value = value.to_local()
        flat = value.reshape(value.shape[0], -1) if value.dim() else value.reshape(1, 1)
        as_int = flat.view(ints[flat.element_size()]).to(torch.int64)
        weights = torch.arange(row0 + 1, row0 + 1 + flat.shape[0], dtype=torch.int64).unsqueeze(1)
        out[fqn] = int((as_int * weights).sum()) % (1 << 64)
    return out


def combine_checksums(per_rank: Sequence[dict[str, int]]) -> dict[str, int]:
    """Sum the :func:`shard_checksum` results of all ranks (mod 2**64)."""
    total: dict[str, int] = {}
    for c in per_rank:
        for k, v in c.items():
            total[k] = (total.get(k, 0) + v) % (1 << 64)
    return total


def state_bytes(state: dict[str, Any]) -> int:
    """Bytes of the local tensors in ``state`` (DTensors count their local shard)."""
    import torch
    from torch.distributed.tensor import DTensor

    total = 0
    for v in state.values():
        if isinstance(v, DTensor):
            v = v.to_local()
        if isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
    return total


# --------------------------------------------------------------------------- ranks


def collective_time(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Inside a rank: run ``fn()`` between barriers; return (seconds, result).

    The barriers make every rank's time the collective's time (start together, end when the
    slowest rank is done), which is what a training job waits for.
    """
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    result = fn()
    dist.barrier()
    return time.perf_counter() - t0, result


# --------------------------------------------------------------------------- formatting


def fmt_rate(nbytes: float, seconds: float) -> str:
    """``nbytes`` in ``seconds`` as decimal GB/s, e.g. ``"1.23 GB/s"``."""
    if seconds <= 0:
        return "inf GB/s"
    return f"{nbytes / seconds / 1e9:.2f} GB/s"


def fmt_bw(bytes_per_s: float) -> str:
    """A bandwidth in bytes/s as decimal GB/s."""
    return f"{bytes_per_s / 1e9:.2f} GB/s"


def fmt_ratio(value: float) -> str:
    """A ratio as ``"1.23x"``."""
    return f"{value:.2f}x"


def fmt_seconds(seconds: float) -> str:
    """Seconds with sensible precision (``"12.3 ms"``, ``"1.23 s"``)."""
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s"


def fmt_bytes(nbytes: float) -> str:
    """Bytes in binary units (``"1.00 GiB"``, ``"512 MiB"``, ``"3.2 KiB"``)."""
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if abs(nbytes) >= scale:
            value = nbytes / scale
            return f"{value:.2f} {unit}" if value < 100 else f"{value:.0f} {unit}"
    return f"{int(nbytes)} B"


_NUMBER = re.compile(r"^\s*([-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)")


def parse_number(cell: Any) -> float | None:
    """The numeric value of a table cell (``"1.23 GB/s"`` -> 1.23), or None.

    Units are scaled so that cells of one column compare (``"512 MiB"`` and ``"1.00 GiB"`` both in
    bytes; ``"12 ms"`` and ``"1.2 s"`` both in seconds).
    """
    if isinstance(cell, (int, float)):
        return float(cell)
    m = _NUMBER.match(str(cell))
    if not m:
        return None
    value = float(m.group(1))
    unit = str(cell)[m.end():].strip()
    scale = {"KiB": 1024, "MiB": MiB, "GiB": GiB, "ms": 1e-3, "us": 1e-6, "µs": 1e-6}.get(unit.split(" ")[0], 1)
    return value * scale


def _is_numeric(cell: str) -> bool:
    """A number with at most one unit word after it (``"1.2 GB/s"``, ``"2.00x"``, ``"12"``)."""
    m = _NUMBER.match(cell)
    return bool(m) and len(cell[m.end():].split()) <= 1


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table; numeric cells are right-aligned."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max([len(str(col))] + [len(r[i]) for r in cells if i < len(r)]) for i, col in enumerate(columns)]
    numeric = [
        any(_is_numeric(r[i]) for r in cells if i < len(r))
        and all(_is_numeric(r[i]) or r[i] in ("-", "") for r in cells if i < len(r))
        for i in range(len(columns))
    ]

    def line(values: Sequence[str]) -> str:
        parts = [v.rjust(w) if numeric[i] else v.ljust(w) for i, (v, w) in enumerate(zip(values, widths))]
        return "| " + " | ".join(parts) + " |"

    sep = "|" + "|".join(("-" * (w + 1) + ":") if numeric[i] else ("-" * (w + 2)) for i, w in enumerate(widths)) + "|"
    return "\n".join([line([str(c) for c in columns]), sep] + [line(r + [""] * (len(columns) - len(r))) for r in cells])


def render(result: dict[str, Any]) -> str:
    """A benchmark's ``run()`` result as Markdown: title, table, notes."""
    out = [f"### {result['title']}", "", markdown_table(result["columns"], result["rows"])]
    notes = result.get("notes") or []
    if notes:
        out.append("")
        out.extend(f"- {n}" for n in notes)
    return "\n".join(out) + "\n"


def check_results(result: Any, *, source: str) -> list[dict[str, Any]]:
    """Validate a ``run()`` result (a dict or a list of dicts) against the contract.

    Returns:
        The result's tables as a list.

    Raises:
        ValueError: A key is missing or has the wrong type, or a row's length differs from the
            number of columns.
    """
    tables = result if isinstance(result, list) else [result]
    if not tables:
        raise ValueError(f"{source}: run() returned an empty list")
    for t in tables:
        if not isinstance(t, dict):
            raise ValueError(f"{source}: run() returned {type(t).__name__}, expected a dict")
        for key, typ in (("title", str), ("columns", list), ("rows", list), ("notes", list)):
            if not isinstance(t.get(key), typ):
                raise ValueError(f"{source}: run() result key {key!r} must be a {typ.__name__}")
        if not t["rows"]:
            raise ValueError(f"{source}: table {t['title']!r} has no rows")
        for i, row in enumerate(t["rows"]):
            if not isinstance(row, (list, tuple)) or len(row) != len(t["columns"]):
                raise ValueError(
                    f"{source}: table {t['title']!r} row {i} has {len(row)} cells, expected {len(t['columns'])}"
                )
    return tables


def bench_main(run: Callable[[bool], Any]) -> None:
    """Entry point of ``python -m benchmarks.bench_<name> [--quick]``: run and print the table."""
    import argparse

    parser = argparse.ArgumentParser(description=(run.__doc__ or "").strip().splitlines()[0] if run.__doc__ else None)
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer repetitions (~1 min)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        tables = check_results(run(args.quick), source=run.__module__)
    finally:
        shutdown_ranks()
    print("\n".join(render(t) for t in tables))
