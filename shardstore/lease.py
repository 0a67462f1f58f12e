"""Lease: at most one job writes (saves, deletes) under a manager root, on any backend.

Why: a :class:`~shardstore.manager.CheckpointManager` deletes things. Retention removes old
steps and gc removes what crashed saves left behind, on the assumption that no other job is
saving there. Two jobs started on the same root by mistake (a resubmitted job while the old one
still runs, two runs sharing a path) would delete each other's unfinished saves. The lease turns
that into a clear error for the second job.

It uses only :class:`~shardstore.backends.Backend` operations, so it works on POSIX, NFS and S3
alike. Objects under ``<root>/_lease/``:

* ``<gen:012d>.owner``: the claim of generation ``gen``, published with ``overwrite=False``. Of
  two jobs claiming the same generation exactly one succeeds (hard link on POSIX,
  ``If-None-Match`` on S3). The highest generation is the current lease.
* ``<gen:012d>.beat``: the owner's heartbeat, rewritten every ``ttl / 4`` seconds; on release
  it says ``released``.

A job takes the lease by claiming the next generation when there is none, when the current one
is released, or when it is stale: its heartbeat did not change while the claimant watched it for
``ttl`` seconds of its own clock (so hosts need no synchronised clocks; the price is that taking
over from a crashed job waits ``ttl``). A live owner's heartbeat changes within ``ttl / 4``, so
the claimant refuses with :class:`LeaseHeldError` naming the owner.

Fencing: before each commit and each deletion the owner makes sure it still holds the lease
(:meth:`Lease.verify`): from the times of its recent heartbeats when they prove that no one can
have watched it stand still for ``ttl``, else by listing ``_lease/`` again. A newer generation
means another job took over (this one stalled for longer
than ``ttl``) and it stops with :class:`LeaseLostError`. A stall of more than ``ttl`` between
that check and the commit itself cannot be excluded; pick ``ttl`` well above the longest pause a
job can see (the default is 60 s).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from typing import Any

import msgpack

from shardstore.backends import Backend
from shardstore.errors import CheckpointExistsError, LeaseError, LeaseHeldError, LeaseLostError, ShardstoreError

logger = logging.getLogger(__name__)

LEASE_DIR = "_lease"

__all__ = ["Lease", "LeaseError", "LeaseHeldError", "LeaseLostError", "LEASE_DIR"]


def _owner_name(gen: int) -> str:
    return f"{LEASE_DIR}/{gen:012d}.owner"


def _beat_name(gen: int) -> str:
    return f"{LEASE_DIR}/{gen:012d}.beat"


def _generation(path: str, ext: str = "owner") -> int | None:
    """The generation a lease object belongs to (``ext``: ``"owner"``, ``"beat"`` or ``""`` for any)."""
    name = path.rsplit("/", 1)[-1]
    stem, _, kind = name.partition(".")
    if len(stem) != 12 or not stem.isdigit() or (ext and kind != ext):
        return None
    return int(stem)


def _decode(data: bytes | None) -> dict[str, Any]:
    if data is None:
        return {}
    try:
        doc = msgpack.unpackb(data, raw=False)
    except (ValueError, msgpack.UnpackException):
        return {}
    return doc if isinstance(doc, dict) else {}


class Lease:
    """The write lease of one manager root (taken by the coordinator rank only).

    Args:
        backend: the backend rooted at the manager root.
        ttl: seconds without a heartbeat after which the lease counts as abandoned.
    """

    def __init__(self, backend: Backend, *, ttl: float = 60.0) -> None:
        if ttl <= 0:
            raise ValueError(f"lease ttl must be positive, got {ttl}")
        self.backend = backend
        self.ttl = float(ttl)
        self.owner_id = uuid.uuid4().hex
        self.generation: int | None = None
        self._count = 0
        self._lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_beat = 0.0
        self._verified = (0.0, 0.0)  # times of the last two store checks followed by a heartbeat

    @property
    def held(self) -> bool:
        return self.generation is not None and self._lost is None

    # -- acquire / release -------------------------------------------------------------------

    def acquire(self) -> None:
        """Take the lease, waiting up to ``ttl`` to tell a crashed owner from a live one.

        Raises:
            LeaseHeldError: another job holds it (its heartbeat is alive), or claimed it at the
                same moment.
        """
        if self.generation is not None:
            return
        gens = self._generations()
        gen = 1
        if gens:
            self._wait_until_free(gens[-1])
            gen = gens[-1] + 1
        claimed_at = time.monotonic()
        me = {
            "owner": self.owner_id, "host": socket.gethostname(), "pid": os.getpid(), "created": time.time(), "ttl": self.ttl,
        }
        try:
            self.backend.publish(_owner_name(gen), msgpack.packb(me), overwrite=False)
        except CheckpointExistsError:
            raise LeaseHeldError(
                f"{self.backend.url} is in use: another job claimed its lease at the same moment "
                f"({_owner_name(gen)}); only one job may save under a root"
            ) from None
        self.generation = gen
        self._beat()
        self._verified = (claimed_at, claimed_at)
        old = [p for p in self.backend.list(LEASE_DIR) if (_generation(p, "") or gen) < gen]
        self.backend.delete(old)  # earlier generations: released or abandoned
        self._thread = threading.Thread(target=self._heartbeat_loop, name="shardstore-lease", daemon=True)
        self._thread.start()
        logger.info("took the lease of %s (generation %d)", self.backend.url, gen)

    def release(self) -> None:
        """Stop the heartbeat and mark the lease released, so the next job takes it at once."""
        if self.generation is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._lost is None:
            self._beat(released=True)
        self.generation = None

    # -- checks ------------------------------------------------------------------------------

    def check(self) -> None:
        """Raise :class:`LeaseLostError` if the heartbeat found the lease taken over."""
        if self._lost is not None:
            raise LeaseLostError(self._lost)
        if self.generation is None:
            raise LeaseLostError(f"the lease of {self.backend.url} is not held by this job")

    def verify(self, *, fresh: bool = False) -> None:
        """Make sure no other job has taken the lease over (before a commit or a deletion).

        A takeover needs this job's heartbeat to stand still for ``ttl`` seconds. Each heartbeat
        lists ``_lease/`` at a time ``V`` and then writes the beat. If the last two such checks
        ``V1 < V2`` are less than ``ttl / 2`` apart and ``V2`` is less than ``ttl / 2`` ago, no
        claim can have been made: a claim before ``V2`` would have been listed, and a claim
        after ``V2`` would need a still heartbeat since before ``V1``'s beat, more than ``ttl``
        before now. Then no request is needed; otherwise, or with ``fresh``, the lease objects
        are listed again.

        Raises:
            LeaseLostError: another job holds a newer generation.
        """
        self.check()
        prev, last = self._verified
        now = time.monotonic()
        if not fresh and last - prev < self.ttl / 2 and now - last < self.ttl / 2:
            return
        newer = [g for g in self._generations() if g > self.generation]  # type: ignore[operator]
        if newer:
            self._lost = self._lost_message(newer[-1])
            raise LeaseLostError(self._lost)

    # -- internals ---------------------------------------------------------------------------

    def _generations(self) -> list[int]:
        return sorted(g for g in map(_generation, self.backend.list(LEASE_DIR)) if g is not None)

    def _read(self, path: str) -> bytes | None:
        try:
            return self.backend.read_small(path)
        except FileNotFoundError:
            return None

    def _describe(self, gen: int) -> str:
        owner = _decode(self._read(_owner_name(gen)))
        if not owner:
            return f"generation {gen}"
        return f"host {owner.get('host')!r}, pid {owner.get('pid')}, since {time.ctime(owner.get('created') or 0)}"

    def _wait_until_free(self, gen: int) -> None:
        first = self._read(_beat_name(gen))
        if _decode(first).get("released"):
            return
        poll = min(max(self.ttl / 8, 0.02), 2.0)
        deadline = time.monotonic() + self.ttl
        logger.info(
            "lease of %s has an owner (%s); watching its heartbeat for %.1f s", self.backend.url, self._describe(gen), self.ttl
        )
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                logger.warning(
                    "lease of %s: owner %s stopped beating; taking over", self.backend.url, self._describe(gen)
                )
                return
            time.sleep(min(poll, left))
            gens = self._generations()
            if not gens or gens[-1] != gen:
                raise LeaseHeldError(f"{self.backend.url} is in use: another job took its lease while this one waited")
            now = self._read(_beat_name(gen))
            if now != first:
                if _decode(now).get("released"):
                    return
                raise LeaseHeldError(
                    f"{self.backend.url} is in use by another job ({self._describe(gen)}): its lease "
                    "heartbeat is alive; only one job may save under a root"
                )

    def _beat(self, *, released: bool = False) -> None:
        self._count += 1
        doc = {"owner": self.owner_id, "count": self._count, "time": time.time(), "released": released}
        self.backend.publish(_beat_name(self.generation), msgpack.packb(doc), overwrite=True)  # type: ignore[arg-type]
        self._last_beat = time.monotonic()

    def _lost_message(self, gen: int) -> str:
        return (
            f"this job lost the lease of {self.backend.url} to another job ({self._describe(gen)}); "
            f"it stalled for more than the lease ttl ({self.ttl:g} s) and must not save there any more"
        )

    def _heartbeat_loop(self) -> None:
        interval = self.ttl / 4
        while not self._stop.wait(interval):
            try:
                checked_at = time.monotonic()
                self.verify(fresh=True)
                self._beat()
                self._verified = (self._verified[1], checked_at)
            except LeaseLostError as e:
                logger.error("%s", e)
                return
            except (OSError, ShardstoreError) as e:  # transient store trouble: keep trying
                logger.warning("lease heartbeat on %s failed: %s", self.backend.url, e)
                if time.monotonic() - self._last_beat > self.ttl:
                    self._lost = f"the lease heartbeat on {self.backend.url} failed for more than {self.ttl:g} s: {e}"
                    logger.error("%s", self._lost)
                    return
