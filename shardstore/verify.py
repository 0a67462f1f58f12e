"""Verify: re-read every stored frame of a checkpoint and check it, without loading anything.

This is the load path's "read → verify checksum → decode" stage run over the whole checkpoint
at once, with no DCP plan and no target tensors: it needs no process group and no model, so
``shardstore verify`` can check a checkpoint on any machine before a run resumes from it (a
silently corrupted checkpoint is otherwise found only when the resumed run diverges).

The index says where every frame lies and holds its XXH3-128 checksum. Frames of each data file
are cut into byte ranges of at most ``max_range`` bytes (whole frames only), the ranges are read
and checked by a thread pool (zstd and xxhash release the GIL), so memory stays at about
``threads * max_range``. Every problem is recorded instead of raised: the report lists each
damaged tensor chunk with its file and byte range, and each data file that is missing or whose
size differs from the index. Failures to reach the storage at all (permissions, network) are
not damage and propagate as errors.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from typing import Any


from shardstore.backends import Backend, open_backend, sibling_url
from shardstore.codec import decode_frame, frame_hash
from shardstore.config import ReadOptions
from shardstore.errors import CorruptCheckpointError, InvalidCheckpointError, TruncatedFileError
from shardstore.index import FileEntry, Index
from shardstore.reader import load_index
from shardstore.values import unpack_value

logger = logging.getLogger(__name__)

#: ``progress(done_bytes, total_bytes)``: called from the calling thread as ranges finish.
ProgressCallback = Callable[[int, int], None]


@dataclass(frozen=True)
class Damage:
    """Damaged frames of one stored chunk: consecutive frames that failed for one reason.

    Attributes:
        tensor: the tensor's fully qualified name.
        chunk_offsets: where the stored chunk starts in the global tensor.
        file: the data file (relative to its checkpoint).
        start: first byte of the damaged range in ``file``.
        end: one past the last byte of the damaged range in ``file``.
        frames: how many frames the range covers.
        reason: what failed (``checksum mismatch``, ``does not decode: ...``, ``truncated``...).
    """

    tensor: str
    chunk_offsets: tuple[int, ...]
    file: str
    start: int
    end: int
    frames: int
    reason: str


@dataclass(frozen=True)
class FileProblem:
    """A data file that is missing or whose size differs from what the index recorded."""

    file: str
    expected_size: int
    actual_size: int | None
    reason: str


@dataclass
class VerifyReport:
    """What :func:`verify_checkpoint` found. ``ok`` is true iff nothing is damaged."""

    checkpoint: str
    files: int
    tensors: int
    chunks: int
    frames: int
    values: int
    stored_bytes: int
    raw_bytes: int
    bytes_read: int = 0
    seconds: float = 0.0
    damage: list[Damage] = field(default_factory=list)
    file_problems: list[FileProblem] = field(default_factory=list)
    bad_values: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.damage or self.file_problems or self.bad_values)

    @property
    def damaged_tensors(self) -> list[str]:
        """Names of the tensors with at least one damaged frame, sorted."""
        return sorted({d.tensor for d in self.damage})

    @property
    def damaged_files(self) -> list[str]:
        """Data files with damaged frames or a size problem, sorted."""
        return sorted({d.file for d in self.damage} | {p.file for p in self.file_problems})

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable form (what ``shardstore verify --json`` prints)."""
        out = asdict(self)
        out["ok"] = self.ok
        out["damaged_tensors"] = self.damaged_tensors
        out["damaged_files"] = self.damaged_files
        for d in out["damage"]:
            d["chunk_offsets"] = list(d["chunk_offsets"])
        return out


@dataclass(frozen=True)
class _Frame:
    """One stored frame to check."""

    fqn: str
    chunk: int
    index: int  # frame id within the tensor's frame table
    pos: int  # byte offset in the data file
    length: int  # stored bytes
    codec: int
    raw_len: int  # raw bytes it decodes to
    digest: bytes


@dataclass(frozen=True)
class _Bad:
    frame: _Frame
    file_id: int
    reason: str


def _frames_by_file(index: Index) -> dict[int, list[_Frame]]:
    """Every frame of the index grouped by data file (``decode_index`` checked the tables agree)."""
    fs = index.frame_size
    by_file: dict[int, list[_Frame]] = {}
    for fqn, t in index.tensors.items():
        fpos = t.frame_pos
        for c in range(len(t.pos)):
            g0, g1 = int(t.frame_start[c]), int(t.frame_start[c + 1])
            raw = t.raw_nbytes(c)
            by_file.setdefault(int(t.file[c]), []).extend(
                _Frame(fqn, c, g, int(fpos[g]), int(t.frame_len[g]), int(t.frame_codec[g]),
                       min(fs, raw - (g - g0) * fs), t.frame_hash[g].tobytes())
                for g in range(g0, g1)
            )
    return by_file


def _cut_ranges(frames: list[_Frame], max_range: int) -> list[list[_Frame]]:
    """Sorted frames cut into runs spanning at most ``max_range`` bytes (a bigger frame alone)."""
    frames.sort(key=lambda f: f.pos)
    runs: list[list[_Frame]] = []
    start = 0
    for f in frames:
        if runs and f.pos + f.length - start <= max_range:
            runs[-1].append(f)
        else:
            runs.append([f])
            start = f.pos
    return runs


def _check_frame(stored: memoryview, frame: _Frame) -> str | None:
    """Why ``frame`` is damaged, or None when it decodes and matches its checksum."""
    try:
        raw = decode_frame(stored, frame.codec, frame.raw_len)
    except CorruptCheckpointError as e:
        return f"does not decode ({e}); checksum cannot be verified"
    if frame_hash(raw) != frame.digest:
        return "checksum mismatch"
    return None


def _check_run(backend: Backend, path: str, file_id: int, run: list[_Frame]) -> tuple[list[_Bad], int]:
    """Read one run of frames in a single ranged read and check each frame."""
    start = run[0].pos
    end = max(f.pos + f.length for f in run)
    try:
        (buf,) = backend.read_ranges(path, [(start, end - start)])
    except TruncatedFileError as e:  # the file shrank after its size was taken
        return [_Bad(f, file_id, f"truncated ({e})") for f in run], 0
    except FileNotFoundError:
        return [_Bad(f, file_id, "data file is missing") for f in run], 0
    view = memoryview(buf)
    bad = []
    for f in run:
        reason = _check_frame(view[f.pos - start : f.pos - start + f.length], f)
        if reason is not None:
            bad.append(_Bad(f, file_id, reason))
    return bad, view.nbytes


def _shown(entry: FileEntry) -> str:
    """A data file's name in reports: relative to this checkpoint (``../<base>/<path>`` for a reference)."""
    return entry.path if entry.base is None else f"../{entry.base}/{entry.path}"


def _damage(index: Index, bad: list[_Bad]) -> list[Damage]:
    """Merge bad frames into ranges: consecutive frames of one chunk with one reason."""
    out: list[Damage] = []
    bad = sorted(bad, key=lambda b: (b.frame.fqn, b.frame.chunk, b.frame.index))
    for b in bad:
        f = b.frame
        t = index.tensors[f.fqn]
        path = _shown(index.files[b.file_id])
        prev = out[-1] if out else None
        if (
            prev is not None
            and prev.tensor == f.fqn
            and prev.file == path
            and prev.reason == b.reason
            and prev.end == f.pos
            and prev.chunk_offsets == tuple(t.offsets[f.chunk].tolist())
        ):
            out[-1] = Damage(prev.tensor, prev.chunk_offsets, path, prev.start, f.pos + f.length, prev.frames + 1, b.reason)
        else:
            out.append(Damage(f.fqn, tuple(t.offsets[f.chunk].tolist()), path, f.pos, f.pos + f.length, 1, b.reason))
    return out


def verify_checkpoint(
    path: str | os.PathLike,
    *,
    storage_options: dict[str, Any] | None = None,
    threads: int = 0,
    max_range: int = 64 << 20,
    progress: ProgressCallback | None = None,
) -> VerifyReport:
    """Re-read every frame of a checkpoint, check its checksum and that it decodes.

    Args:
        path: checkpoint directory or URL.
        storage_options: passed to fsspec (e.g. ``{"endpoint_url": ...}`` for S3).
        threads: parallel reader threads (0: the reader's default).
        max_range: bytes per ranged read; memory use is about ``threads * max_range``.
        progress: called as ``progress(done_bytes, total_bytes)`` from the calling thread
            after each range is checked (and once at the start with ``done_bytes=0``).

    Returns:
        A :class:`VerifyReport`; damage is reported there, not raised.

    Raises:
        CheckpointNotFoundError: no committed checkpoint at ``path``.
        InvalidCheckpointError: the index is malformed.
        StorageError: the storage cannot be read at all.
    """
    opts = ReadOptions(threads=threads, max_range=max_range)
    t0 = time.perf_counter()
    backend = open_backend(os.fspath(path), storage_options)
    siblings: dict[str, Backend] = {}
    try:
        index = load_index(backend)

        def locate(entry: FileEntry) -> tuple[Backend, str]:
            if entry.base is None:
                return backend, entry.path
            if entry.base not in siblings:
                siblings[entry.base] = open_backend(sibling_url(os.fspath(path), entry.base), storage_options)
            return siblings[entry.base], entry.path

        report = _verify(index, backend.url, [locate(f) for f in index.files], opts, progress)
    finally:
        for b in (backend, *siblings.values()):
            b.close()
    report.seconds = time.perf_counter() - t0
    logger.info(
        "verified %s: %d frames, %.1f MB read, %.2f s, %s",
        report.checkpoint, report.frames, report.bytes_read / 1e6, report.seconds,
        "ok" if report.ok else f"{len(report.damaged_tensors)} damaged tensors",
    )
    return report


def _verify(
    index: Index,
    url: str,
    locations: list[tuple[Backend, str]],
    opts: ReadOptions,
    progress: ProgressCallback | None,
) -> VerifyReport:
    """Check every value, file size and frame of ``index``; ``locations[i]`` holds file ``i``."""
    by_file = _frames_by_file(index)
    bad: list[_Bad] = []
    report = VerifyReport(
        checkpoint=url,
        files=len(index.files),
        tensors=len(index.tensors),
        chunks=sum(len(t.pos) for t in index.tensors.values()),
        frames=sum(len(t.frame_len) for t in index.tensors.values()),
        values=len(index.values),
        stored_bytes=index.stored_nbytes(),
        raw_bytes=index.raw_nbytes(),
    )
    for key, data in index.values.items():
        try:
            unpack_value(data)
        except InvalidCheckpointError as e:
            report.bad_values.append(f"{key}: {e}")

    def size(location: tuple[Backend, str]) -> int | None:
        try:
            return location[0].size(location[1])
        except FileNotFoundError:
            return None

    with ThreadPoolExecutor(opts.threads, "shardstore-verify") as pool:
        sizes = list(pool.map(size, locations))
        runs: list[tuple[int, list[_Frame]]] = []
        for fid, entry in enumerate(index.files):
            actual = sizes[fid]
            if actual is None:
                report.file_problems.append(FileProblem(_shown(entry), entry.size, None, "missing"))
            elif actual != entry.size:
                what = "truncated" if actual < entry.size else "longer than the index says"
                report.file_problems.append(FileProblem(_shown(entry), entry.size, actual, what))
            readable = []
            for f in by_file.get(fid, []):
                if actual is None:
                    bad.append(_Bad(f, fid, "data file is missing"))
                elif f.pos + f.length > actual:
                    bad.append(_Bad(f, fid, f"truncated: the file ends at byte {actual}"))
                else:
                    readable.append(f)
            runs.extend((fid, run) for run in _cut_ranges(readable, opts.max_range))

        spans = [run[-1].pos + run[-1].length - run[0].pos for _, run in runs]
        total, done = sum(spans), 0
        if progress is not None:
            progress(0, total)
        pending = {pool.submit(_check_run, *locations[fid], fid, run): span for (fid, run), span in zip(runs, spans)}
        try:
            while pending:
                finished, _ = wait(pending, return_when=FIRST_COMPLETED)
                for fut in finished:
                    done += pending.pop(fut)
                    run_bad, nbytes = fut.result()
                    bad.extend(run_bad)
                    report.bytes_read += nbytes
                if progress is not None:
                    progress(done, total)
        except BaseException:  # storage failure or interrupt: drop the queued reads, then raise
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    report.damage = _damage(index, bad)
    return report
