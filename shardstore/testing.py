"""Run a function on N real ranks (gloo, CPU) from a test or a benchmark.

Checkpoint code has to be tried at several world sizes (save on 4, resume on 2), and importing
torch takes seconds per process, so the ranks are a pool of long-lived spawned worker processes,
reused across calls. Each call forms a fresh gloo process group of the requested size among the
first N workers, runs the function on every rank, returns each rank's result, and destroys the
group again. A call that fails on a rank raises with every rank's traceback; one that hangs
tears the pool down, so the next call starts clean.

Usage::

    from shardstore.testing import run_ranks

    def _save(path):                         # module level: workers import it by name
        rank = torch.distributed.get_rank()
        ...
        return something_picklable

    results = run_ranks(4, _save, "/tmp/ckpt")   # one result per rank

shardstore's own tests and benchmarks use it; it needs nothing but torch.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing as mp
import os
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

__all__ = ["MAX_RANKS", "run_ranks", "shutdown_ranks"]

#: The most ranks one call can use (worker processes are kept between calls).
MAX_RANKS = 8


def _worker(conn: Any) -> None:
    import torch
    import torch.distributed as dist

    while True:
        msg = conn.recv()
        if msg is None:
            return
        fn, args, kwargs, rank, world_size, port = msg
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, world_size)))
        try:
            dist.init_process_group(
                "gloo",
                init_method=f"tcp://127.0.0.1:{port}",
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=600),
            )
            conn.send(("ok", fn(*args, **kwargs)))
        except BaseException:  # report everything to the driver, keep the worker alive
            conn.send(("error", traceback.format_exc()))
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


class _RankPool:
    """Up to ``MAX_RANKS`` spawned worker processes that form gloo groups of any size."""

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
        for _, conn in self._workers:
            with contextlib.suppress(BrokenPipeError, OSError):
                conn.send(None)
        deadline = time.monotonic() + 3
        for proc, _ in self._workers:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=1)
        self._workers = []

    def run(self, world_size: int, fn: Callable, args: tuple, kwargs: dict, timeout: float) -> list[Any]:
        if not 1 <= world_size <= MAX_RANKS:
            raise ValueError(f"world_size must be in 1..{MAX_RANKS}, got {world_size}")
        with self._lock:
            self._ensure(world_size)
            port = _free_port()
            workers = self._workers[:world_size]
            for rank, (_, conn) in enumerate(workers):
                conn.send((fn, args, kwargs, rank, world_size, port))
            results, errors = [], []
            for rank, (_, conn) in enumerate(workers):
                if not conn.poll(timeout):
                    self.shutdown()
                    raise TimeoutError(f"rank {rank} did not finish {fn.__name__} within {timeout} s")
                try:
                    status, value = conn.recv()
                except (EOFError, OSError) as e:
                    self.shutdown()
                    raise RuntimeError(
                        f"rank {rank} worker process died while running {fn.__name__} ({e!r}); a script that "
                        "calls run_ranks needs an `if __name__ == '__main__':` guard"
                    ) from None
                if status == "ok":
                    results.append(value)
                else:
                    errors.append(f"--- rank {rank} ---\n{value}")
            if errors:
                raise RuntimeError(f"{fn.__name__} failed on {len(errors)} rank(s):\n" + "\n".join(errors))
            return results


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_pool: _RankPool | None = None


def run_ranks(world_size: int, fn: Callable, *args: Any, timeout: float = 600, **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return the results by rank.

    The ranks are long-lived spawned processes (importing torch costs seconds), reused across
    calls; each call forms a fresh process group. ``fn`` must be a module-level function of an
    importable module (a function of a module run with ``python -m`` works too). Each rank sets
    torch's thread count to ``cpu_count // world_size``.

    Raises:
        RuntimeError: ``fn`` raised on some rank (the message holds every rank's traceback).
        TimeoutError: A rank did not answer within ``timeout`` seconds (the pool is torn down).
    """
    global _pool
    if _pool is None:
        _pool = _RankPool()
        atexit.register(shutdown_ranks)
    return _pool.run(world_size, _importable(fn), args, kwargs, timeout)


def shutdown_ranks() -> None:
    """Stop the rank worker processes (they are also stopped at exit)."""
    global _pool
    if _pool is not None:
        _pool.shutdown()
        _pool = None


def _importable(fn: Callable) -> Callable:
    """``fn`` as its workers can unpickle it: a ``__main__`` function by its real module name."""
    if fn.__module__ != "__main__":
        return fn
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    if spec is None or not spec.name:
        return fn
    import importlib

    module = importlib.import_module(spec.name)
    return getattr(module, fn.__qualname__)
