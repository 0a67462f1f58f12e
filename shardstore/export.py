"""Export: a sharded checkpoint streamed into one safetensors (or ``torch.save``) file.

The end of the save flow for people who hand a model to inference: consolidation, without a
machine that can hold the model. The output's layout is known from the index alone (names,
dtypes, shapes), so the header is written first; then each tensor is filled in file order, box
by box (:mod:`shardstore.inspect`: contiguous row-major runs of at most a read window), read and
verified by :class:`~shardstore.ShardReader`, cast if asked, and written at its offset. Memory is
bounded by the window (a few times it, for read buffers and decoded frames), never by the model
or its largest tensor, and the output is written strictly front to back, so it can stream to
object storage as well as to a local file.

Safetensors: an 8-byte little-endian header length, a JSON header ``{name: {dtype, shape,
data_offsets}, "__metadata__": {...}}`` padded with spaces to 8 bytes, then the tensors back to
back (ordered by alignment, then name, as the ``safetensors`` library writes them).

``torch.save``: ``torch.serialization.skip_data`` writes the archive with the space for every
storage reserved but unwritten (from placeholder tensors that map a sparse scratch file, so they
hold no memory); the tensors are then filled at the offsets of their zip records. Local paths
only (the fill is positional).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import posixpath
import struct
import time
import uuid
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import torch

from shardstore.backends import open_backend
from shardstore.errors import CheckpointExistsError, InvalidCheckpointError
from shardstore.index import Index
from shardstore.inspect import DEFAULT_WINDOW, Box, RegionReader, batch_boxes
from shardstore.progress import Progress, silent

logger = logging.getLogger(__name__)

FORMATS = ("safetensors", "torch")

#: safetensors dtype names, both directions.
SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint64: "U64",
    torch.uint32: "U32",
    torch.uint16: "U16",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.complex64: "C64",
}
TORCH_DTYPES: dict[str, torch.dtype] = {v: k for k, v in SAFETENSORS_DTYPES.items()}

_DTYPE_ALIASES = {
    "fp64": torch.float64, "double": torch.float64, "fp32": torch.float32, "float": torch.float32,
    "fp16": torch.float16, "half": torch.float16, "bf16": torch.bfloat16,
    "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
}
#: Largest safetensors header the safetensors library accepts.
MAX_HEADER = 100_000_000


def parse_dtype(name: str) -> torch.dtype:
    """A floating dtype by name: ``bf16``/``bfloat16``, ``fp16``/``float16``, ``fp32``/``float32``...

    Raises:
        ValueError: not a floating-point dtype name.
    """
    key = name.lower().removeprefix("torch.")
    dtype = _DTYPE_ALIASES.get(key) or getattr(torch, key, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"{name!r} is not a floating-point dtype (try bf16, fp16, fp32)")
    return dtype


# ---------------------------------------------------------------------------------------------
# The safetensors header, both directions


@dataclass(frozen=True)
class SafetensorsEntry:
    """One tensor of a safetensors file: dtype, shape and its byte span in the data section."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def encode_safetensors_header(
    tensors: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str] | None = None
) -> tuple[bytes, list[SafetensorsEntry]]:
    """Header bytes (length prefix included) for ``tensors`` laid out in the given order."""
    doc: dict[str, Any] = {}
    if metadata:
        doc["__metadata__"] = dict(metadata)
    entries, pos = [], 0
    for name, dtype, shape in tensors:
        if dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"tensor {name!r} has dtype {dtype}, which safetensors cannot hold")
        nbytes = math.prod(shape) * dtype.itemsize
        doc[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        entries.append(SafetensorsEntry(name, dtype, tuple(shape), pos, pos + nbytes))
        pos += nbytes
    text = json.dumps(doc, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, entries


def decode_safetensors_header(header: bytes, *, source: str) -> tuple[dict[str, SafetensorsEntry], dict[str, str]]:
    """Parse the JSON header of a safetensors file (without its 8-byte length prefix).

    Returns:
        ``({name: entry}, metadata)``; entry offsets are relative to the data section.

    Raises:
        InvalidCheckpointError: not a valid safetensors header; the message names ``source``.
    """
    try:
        doc = json.loads(header)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidCheckpointError(f"{source} is not a safetensors file (header is not JSON: {e})") from None
    if not isinstance(doc, dict):
        raise InvalidCheckpointError(f"{source} is not a safetensors file (header is not a JSON object)")
    metadata = doc.pop("__metadata__", None) or {}
    entries: dict[str, SafetensorsEntry] = {}
    for name, info in doc.items():
        try:
            dtype = TORCH_DTYPES[info["dtype"]]
            shape = tuple(int(s) for s in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidCheckpointError(f"{source}: header entry {name!r} is malformed ({e!r})") from None
        if any(s < 0 for s in shape) or begin < 0 or end - begin != math.prod(shape) * dtype.itemsize:
            raise InvalidCheckpointError(f"{source}: header entry {name!r} has inconsistent shape and offsets")
        entries[name] = SafetensorsEntry(name, dtype, shape, begin, end)
    return entries, metadata


# ---------------------------------------------------------------------------------------------
# What to export


@dataclass(frozen=True)
class ExportTensor:
    """One tensor of the output: its source name in the checkpoint and its name and dtype out."""

    source: str
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


def select(
    index: Index, *, prefixes: list[str] | None = None, strip_prefix: str | None = None, dtype: torch.dtype | None = None
) -> tuple[list[ExportTensor], dict[str, str]]:
    """Choose the tensors (and non-tensor values) to export and their output names.

    Args:
        index: the checkpoint's index.
        prefixes: keep only names starting with one of these (all when empty).
        strip_prefix: remove this prefix from the names that have it.
        dtype: cast floating-point tensors to it (integer and bool tensors keep theirs).

    Returns:
        ``(tensors in safetensors order, {value name in checkpoint: output name})``.

    Raises:
        ValueError: nothing selected, or two names collide or become empty after stripping.
    """

    def keep(name: str) -> bool:
        return not prefixes or any(name.startswith(p) for p in prefixes)

    def rename(name: str) -> str:
        return name[len(strip_prefix) :] if strip_prefix and name.startswith(strip_prefix) else name

    out: list[ExportTensor] = []
    for fqn, t in index.tensors.items():
        if keep(fqn):
            cast = dtype if dtype is not None and t.dtype.is_floating_point else t.dtype
            out.append(ExportTensor(fqn, rename(fqn), cast, tuple(t.shape)))
    values = {k: rename(k) for k in index.values if keep(k)}
    if not out and not values:
        wanted = f" starting with {', '.join(map(repr, prefixes))}" if prefixes else ""
        raise ValueError(f"the checkpoint has no tensors{wanted}")
    seen: dict[str, str] = {}
    for src, name in [(t.source, t.name) for t in out] + list(values.items()):
        if not name:
            raise ValueError(f"stripping {strip_prefix!r} leaves {src!r} without a name")
        if name in seen:
            raise ValueError(f"{seen[name]!r} and {src!r} are both exported as {name!r}")
        seen[name] = src
    out.sort(key=lambda e: (-e.dtype.itemsize, e.name))
    return out, values


@dataclass
class ExportResult:
    """What :func:`export_checkpoint` wrote."""

    out: str
    format: str
    tensors: int
    data_bytes: int
    file_bytes: int
    bytes_read: int
    seconds: float
    skipped_values: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------------------------
# Filling tensors, box by box


def _filled(reader: RegionReader, tensors: list[ExportTensor], progress: Progress) -> Iterator[tuple[ExportTensor, Box, memoryview]]:
    """Every box of every tensor, in output order, read, cast and as bytes.

    The consumer drops each view before asking for the next, so only one batch is alive.
    """
    by_source = {t.source: t for t in tensors}
    itemsizes = reader.itemsizes()
    boxes = (box for t in tensors for box in reader.boxes(t.source))
    for batch in batch_boxes(boxes, itemsizes, reader.window):
        datas = reader.read(batch)
        for i, box in enumerate(batch):
            t = by_source[box.fqn]
            data, datas[i] = datas[i], None  # each box's buffer is freed once written
            if data.dtype != t.dtype:
                data = data.to(t.dtype)
            progress.update(data.numel() * itemsizes[box.fqn])
            yield t, box, memoryview(data.reshape(-1).view(torch.uint8).numpy())
            del data


class _Sink:
    """The output file, written front to back; visible under its name only once complete.

    Local paths: a temporary file in the same directory, fsynced and renamed into place.
    URLs: the backend's writer (an S3 multipart upload completes only on close).
    """

    def __init__(self, out: str, *, storage_options: dict[str, Any] | None, overwrite: bool) -> None:
        self.out = out
        self.local = "://" not in out or out.startswith("file://")
        if self.local:
            self.path = os.path.abspath(out.removeprefix("file://"))
            if os.path.isdir(self.path):
                raise CheckpointExistsError(f"{self.path} is a directory; give the output file's name")
            if os.path.exists(self.path) and not overwrite:
                raise CheckpointExistsError(f"{self.path} already exists; pass --overwrite to replace it")
            parent = os.path.dirname(self.path)
            if not os.path.isdir(parent):
                raise FileNotFoundError(f"output directory {parent} does not exist")
            self.tmp = os.path.join(parent, f".{os.path.basename(self.path)}.tmp-{uuid.uuid4().hex[:8]}")
            self.file: BinaryIO = open(self.tmp, "wb")
        else:
            parent, name = posixpath.split(out.rstrip("/"))
            self.backend = open_backend(parent, storage_options)
            if self.backend.exists(name) and not overwrite:
                raise CheckpointExistsError(f"{out} already exists; pass --overwrite to replace it")
            self.writer = self.backend.open_writer(name)
        self.written = 0

    def write(self, data: memoryview | bytes) -> None:
        (self.file if self.local else self.writer).write(data)
        self.written += len(data) if isinstance(data, bytes) else data.nbytes

    def commit(self) -> None:
        if self.local:
            if not self.file.closed:  # else it was written by position and fsynced there
                self.file.flush()
                os.fsync(self.file.fileno())
                self.file.close()
            os.replace(self.tmp, self.path)
        else:
            self.writer.close()

    def abort(self) -> None:
        if self.local:
            self.file.close()
            try:
                os.unlink(self.tmp)
            except FileNotFoundError:
                pass
        else:
            self.writer.abort()


def _export_safetensors(reader: RegionReader, tensors: list[ExportTensor], sink: _Sink, progress: Progress) -> int:
    header, entries = encode_safetensors_header([(t.name, t.dtype, t.shape) for t in tensors], {"format": "pt"})
    if len(header) > MAX_HEADER:
        raise ValueError(f"the safetensors header would be {len(header)} bytes; the format allows {MAX_HEADER}")
    sink.write(header)
    for _t, _box, data in _filled(reader, tensors, progress):
        sink.write(data)
        del data
    expected = len(header) + (entries[-1].end if entries else 0)
    if sink.written != expected:
        raise AssertionError(f"export wrote {sink.written} bytes, the header describes {expected}")
    return expected - len(header)


def _zip_data_offsets(path: str) -> dict[str, tuple[int, int]]:
    """``{storage key: (data offset, size)}`` of the ``data/<key>`` records of a torch.save archive."""
    out = {}
    with open(path, "rb") as f, zipfile.ZipFile(f) as z:
        for info in z.infolist():
            head, sep, key = info.filename.rpartition("/data/")
            if not sep or "/" in head:
                continue
            if info.compress_type != zipfile.ZIP_STORED:
                raise AssertionError(f"torch.save stored record {info.filename} compressed")
            f.seek(info.header_offset)
            local = f.read(30)
            name_len, extra_len = struct.unpack("<HH", local[26:30])
            out[key] = (info.header_offset + 30 + name_len + extra_len, info.file_size)
    return out


def _nested_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Tensors inside a decoded value, in the order pickle meets them."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _nested_tensors(k)
            yield from _nested_tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _nested_tensors(v)


def _placeholders(tensors: list[ExportTensor], scratch: str) -> dict[str, torch.Tensor]:
    """CPU tensors of the right dtype and shape whose storage is never touched.

    Each maps a sparse scratch file (``MAP_SHARED``): no memory is committed or resident, and
    ``torch.save`` under ``skip_data`` only asks their sizes.
    """
    largest = max((math.prod(t.shape) * t.dtype.itemsize for t in tensors), default=0)
    with open(scratch, "wb") as f:
        f.truncate(largest)
    out = {}
    for t in tensors:
        nbytes = math.prod(t.shape) * t.dtype.itemsize
        if nbytes == 0:
            out[t.name] = torch.empty(t.shape, dtype=t.dtype)
            continue
        storage = torch.UntypedStorage.from_file(scratch, shared=True, nbytes=nbytes)
        out[t.name] = torch.empty(0, dtype=t.dtype).set_(storage, 0, t.shape)
    return out


def _export_torch(
    reader: RegionReader, tensors: list[ExportTensor], values: dict[str, str], sink: _Sink, progress: Progress
) -> int:
    if not sink.local:
        raise ValueError("torch.save output is written by offset and needs a local path; export safetensors to a URL")
    sink.file.close()  # from here on the file is written by position
    scratch = sink.tmp + ".scratch"
    try:
        obj: dict[str, Any] = _placeholders(tensors, scratch)
        decoded = {name: reader.value(src) for src, name in values.items()}
        obj.update(decoded)
        with torch.serialization.skip_data():
            torch.save(obj, sink.tmp)
        del obj
    finally:
        os.unlink(scratch)
    records = _zip_data_offsets(sink.tmp)
    # Storage keys follow pickling order: the exported tensors first, then tensors nested in values.
    fills = list(enumerate(_nested_tensors(list(decoded.values())), start=len(tensors)))
    if len(records) != len(tensors) + len(fills):
        raise AssertionError(f"torch.save wrote {len(records)} storages for {len(tensors) + len(fills)} tensors")
    where = {t.source: records[str(i)] for i, t in enumerate(tensors)}
    total = 0
    fd = os.open(sink.tmp, os.O_WRONLY)
    try:
        for t, box, data in _filled(reader, tensors, progress):
            offset, size = where[t.source]
            pos = offset + box.start * t.dtype.itemsize
            if pos + data.nbytes > offset + size:
                raise AssertionError(f"box of {t.name!r} overruns its torch.save record")
            _pwrite_all(fd, data, pos)
            total += data.nbytes
            del data
        for i, tensor in fills:
            offset, size = records[str(i)]
            raw = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            if len(raw) != size:
                raise AssertionError(f"nested value tensor {i} has {len(raw)} bytes, its record {size}")
            _pwrite_all(fd, raw, offset)
        os.fsync(fd)
    finally:
        os.close(fd)
    sink.written = os.path.getsize(sink.tmp)
    return total


def _pwrite_all(fd: int, data: memoryview | bytes, pos: int) -> None:
    view = memoryview(data).cast("B")
    while view.nbytes:
        n = os.pwrite(fd, view, pos)
        view, pos = view[n:], pos + n


def export_checkpoint(
    path: str | os.PathLike,
    out: str | os.PathLike,
    *,
    format: str = "safetensors",
    prefixes: list[str] | None = None,
    strip_prefix: str | None = None,
    dtype: torch.dtype | None = None,
    window: int = DEFAULT_WINDOW,
    threads: int = 0,
    overwrite: bool = False,
    storage_options: dict[str, Any] | None = None,
    progress: Progress | None = None,
) -> ExportResult:
    """Write the checkpoint at ``path`` (any world size) as one file at ``out``.

    Args:
        path: checkpoint directory or URL.
        out: output file path (or URL, for safetensors).
        format: ``"safetensors"`` or ``"torch"`` (a ``torch.save`` dict, loadable with
            ``torch.load(out, weights_only=True)``; non-tensor values included).
        prefixes: export only names starting with one of these.
        strip_prefix: remove this prefix from the output names.
        dtype: cast floating-point tensors to this dtype.
        window: bytes of tensor data read at a time (memory is a small multiple of it).
        threads: parallel reader threads (0: the default).
        overwrite: replace an existing output file.
        storage_options: fsspec options for both ``path`` and ``out``.
        progress: a byte counter to advance.

    Returns:
        What was written.

    Raises:
        CheckpointNotFoundError: ``path`` holds no committed checkpoint.
        CheckpointExistsError: ``out`` exists and ``overwrite`` is false.
        CorruptCheckpointError: stored bytes fail their checksum.
        ValueError: bad selection (nothing selected, names collide) or format.
    """
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    t0 = time.perf_counter()
    progress = progress or silent()
    reader = RegionReader(path, storage_options=storage_options, window=window, threads=threads)
    tensors, values = select(reader.index, prefixes=prefixes, strip_prefix=strip_prefix, dtype=dtype)
    total = sum(math.prod(t.shape) * reader.index.tensors[t.source].itemsize for t in tensors)
    progress.set_total(total)
    sink = _Sink(os.fspath(out), storage_options=storage_options, overwrite=overwrite)
    try:
        if format == "safetensors":
            data_bytes = _export_safetensors(reader, tensors, sink, progress)
            skipped = sorted(values)
        else:
            data_bytes = _export_torch(reader, tensors, values, sink, progress)
            skipped = []
        sink.commit()
    except BaseException:
        sink.abort()
        raise
    seconds = time.perf_counter() - t0
    logger.info(
        "exported %s to %s: %d tensors, %.1f MB, %.2f s", reader.url, sink.out, len(tensors), data_bytes / 1e6, seconds
    )
    return ExportResult(
        out=sink.out, format=format, tensors=len(tensors), data_bytes=data_bytes, file_bytes=sink.written,
        bytes_read=reader.bytes_read, seconds=round(seconds, 3), skipped_values=skipped,
    )
