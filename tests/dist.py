"""Run a function on N real ranks (gloo, CPU) from a test.

Importing torch takes seconds per process on a small machine, so the ranks are a pool of
long-lived worker processes (spawned once per test session). Each call forms a fresh process
group of the requested size among the first N workers, runs the function on every rank, and
destroys the group again. A call that fails or hangs tears the pool down, so the next test
starts clean.

Usage::

    from dist import run_ranks

    def _save(path):                         # module level: workers import it by name
        rank = dist.get_rank()
        ...
        return something_picklable

    def test_x(tmp_path):
        results = run_ranks(4, _save, str(tmp_path))   # one result per rank
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import socket
import threading
import traceback
from datetime import timedelta
from typing import Any, Callable

_MAX_RANKS = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(conn) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    while True:
        msg = conn.recv()
        if msg is None:
            return
        fn, args, kwargs, rank, world_size, port = msg
        try:
            if world_size:
                dist.init_process_group(
                    "gloo",
                    init_method=f"tcp://127.0.0.1:{port}",
                    rank=rank,
                    world_size=world_size,
                    timeout=timedelta(seconds=90),
                )
            conn.send(("ok", fn(*args, **kwargs)))
        except BaseException:  # report everything to the test, keep the worker alive
            conn.send(("error", traceback.format_exc()))
        finally:
            if world_size and dist.is_initialized():
                dist.destroy_process_group()


class RankPool:
    """Up to ``_MAX_RANKS`` worker processes that can form process groups of any size."""

    def __init__(self) -> None:
        self._ctx = mp.get_context("spawn")
        self._workers: list[tuple[Any, Any]] = []
        self._lock = threading.Lock()

    def _ensure(self, n: int) -> None:
        while len(self._workers) < n:
            parent, child = self._ctx.Pipe()
            proc = self._ctx.Process(target=_worker, args=(child,), daemon=True)
            proc.start()
            self._workers.append((proc, parent))

    def shutdown(self) -> None:
        for proc, conn in self._workers:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc, _ in self._workers:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
        self._workers = []

    def run(self, world_size: int, fn: Callable, *args: Any, timeout: float = 240, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return each rank's result."""
        if not 1 <= world_size <= _MAX_RANKS:
            raise ValueError(f"world_size must be in 1..{_MAX_RANKS}")
        with self._lock:
            self._ensure(world_size)
            port = _free_port()
            workers = self._workers[:world_size]
            for rank, (_, conn) in enumerate(workers):
                conn.send((fn, args, kwargs, rank, world_size, port))
            results, errors = [], []
            for rank, (proc, conn) in enumerate(workers):
                if not conn.poll(timeout):
                    self.shutdown()
                    raise TimeoutError(f"rank {rank} did not finish {fn.__name__} within {timeout} s")
                status, value = conn.recv()
                if status == "ok":
                    results.append(value)
                else:
                    errors.append(f"--- rank {rank} ---\n{value}")
            if errors:
                raise AssertionError(f"{fn.__name__} failed on {len(errors)} rank(s):\n" + "\n".join(errors))
            return results


_pool: RankPool | None = None


def run_ranks(world_size: int, fn: Callable, *args: Any, **kwargs: Any) -> list[Any]:
    """Run ``fn`` on ``world_size`` gloo ranks (a module-level function); results by rank."""
    global _pool
    if _pool is None:
        _pool = RankPool()
        atexit.register(_pool.shutdown)
    return _pool.run(world_size, fn, *args, **kwargs)


os.environ.setdefault("OMP_NUM_THREADS", "1")
