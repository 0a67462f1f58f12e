"""Tunables and their defaults, in one place.

Each option of :class:`~shardstore.ShardWriter` / :class:`~shardstore.ShardReader` that is not a
path is a field here, so defaults are documented once and validated once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

MiB = 1 << 20

#: Name of the index object inside a checkpoint. Its atomic publish is the commit.
INDEX_NAME = "index.shardstore"


def _default_threads() -> int:
    return max(2, min(8, os.cpu_count() or 2))


@dataclass(frozen=True)
class WriteOptions:
    """How a rank writes its shards.

    Attributes:
        threads: parallel writer threads per rank; each writes its own data file, so
            ``threads`` is also the number of files per rank.
        frame_size: raw bytes per frame. A frame is the unit of checksum, compression and
            random access: a partial (resharded) load reads and decodes whole frames only, so
            smaller frames read fewer extra bytes (2->4-rank load of 1 GiB: 4 MiB frames read
            1.25x the checkpoint, 1 MiB 1.06x, 256 KiB 1.02x) at the cost of a larger index.
        compression: ``None`` or ``"zstd"``.
        level: zstd level (1 is fast and already gets most of the gain on float weights).
        min_saving: a frame is stored compressed only if it shrinks by at least this share.
        overwrite: replace a committed checkpoint at the same path (atomically, index last)
            instead of refusing with ``CheckpointExistsError``.
        sync: fsync data files, directories and the index (durable saves). Off only for tests
            and scratch space.
        incremental_base: name of a sibling checkpoint (same parent directory or prefix, e.g.
            ``"step-000000000010"``). Chunks whose dtype, shape, offsets and frame checksums equal
            the base's are not written again: the index references the file that holds them.
    """

    threads: int = 0
    frame_size: int = 512 << 10
    compression: str | None = None
    level: int = 1
    min_saving: float = 0.03
    overwrite: bool = False
    sync: bool = True
    incremental_base: str | None = None

    def __post_init__(self) -> None:
        if self.threads == 0:
            object.__setattr__(self, "threads", _default_threads())
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.incremental_base is not None and (
            not self.incremental_base or "/" in self.incremental_base or self.incremental_base in (".", "..")
        ):
            raise ValueError(f"incremental_base must be a sibling checkpoint's name, got {self.incremental_base!r}")
        if not (4096 <= self.frame_size <= 1 << 30) or self.frame_size % 8:
            raise ValueError(f"frame_size must be a multiple of 8 in [4 KiB, 1 GiB], got {self.frame_size}")
        if self.compression not in (None, "zstd"):
            raise ValueError(f"compression must be None or 'zstd', got {self.compression!r}")
        if not 1 <= self.level <= 22:
            raise ValueError(f"level must be in 1..22, got {self.level}")


@dataclass(frozen=True)
class ReadOptions:
    """How a rank reads its shards.

    Attributes:
        threads: parallel reader threads per rank.
        max_range: the frames of one file are read in runs of at most this many bytes (cut
            at frame boundaries; a larger frame is read alone). Raw frames land in the target
            tensors, so beyond them a load holds at most ``threads * max_range`` bytes of
            scratch, plus a staging copy of the read items being cast or scattered into
            non-contiguous targets. Small runs stay in the CPU cache between the read and the
            checksum (4 MiB loaded 1 GiB 1.6-2.6x faster than 64 MiB here). A store that wants
            larger requests raises it for its files (``Backend.read_size``; S3: ``part_size``
            x ``max_concurrency``, 128 MiB by default); such stores read into new buffers, so
            a load from S3 holds up to ``threads`` x that much.
        verify: check every frame's checksum (on by default; off only for benchmarks).
    """

    threads: int = 0
    max_range: int = 4 * MiB
    verify: bool = True

    def __post_init__(self) -> None:
        if self.threads == 0:
            object.__setattr__(self, "threads", _default_threads())
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.max_range < 1:
            raise ValueError(f"max_range must be positive, got {self.max_range}")
