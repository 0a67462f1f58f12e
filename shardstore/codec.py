"""Frame codec: checksum, byte-grouping filter and zstd for one frame, both directions.

A record (one stored chunk of a tensor) is cut into frames of ``frame_size`` raw bytes. Each
frame is hashed (XXH3-128 of its raw bytes), optionally byte-grouped and zstd-compressed, and
stored compressed only if that saves at least ``min_saving``. Frames are independent, so a
partial load decodes only the frames it needs, and frames compress in parallel threads
(zstandard and xxhash release the GIL).

Byte grouping: for 2- and 4-byte floats the bytes of every value are split into planes (all
byte 0s, then all byte 1s, ...). The plane holding the exponents repeats a lot, the mantissa
planes hardly at all; each plane is compressed on its own and kept raw when zstd cannot shrink it,
which is both smaller and faster than compressing the interleaved bytes. A byte-grouped frame is
stored as ``k`` little-endian uint32 words (plane length, top bit set when that plane is zstd)
followed by the ``k`` planes.
"""

from __future__ import annotations

import enum
import struct
import threading

import numpy as np
import xxhash
import zstandard

from shardstore.errors import CorruptCheckpointError

HASH_NAME = "xxh3-128"
HASH_SIZE = 16


class Codec(enum.IntEnum):
    """How one frame is stored (the ``codec`` column of the frame table)."""

    RAW = 0
    ZSTD = 1
    ZSTD_BYTEGROUP2 = 2
    ZSTD_BYTEGROUP4 = 3


_BYTEGROUP = {Codec.ZSTD_BYTEGROUP2: 2, Codec.ZSTD_BYTEGROUP4: 4}
_PLANE_ZSTD = 1 << 31
_local = threading.local()


def frame_hash(raw: memoryview | bytes) -> bytes:
    """Checksum of a frame's raw bytes (also the identity used by incremental saves)."""
    return xxhash.xxh3_128_digest(raw)


def choose_codec(compression: str | None, is_float: bool, itemsize: int) -> Codec:
    """The codec a record's frames are compressed with (before the "did it shrink" check)."""
    if compression is None:
        return Codec.RAW
    if is_float and itemsize == 2:
        return Codec.ZSTD_BYTEGROUP2
    if is_float and itemsize == 4:
        return Codec.ZSTD_BYTEGROUP4
    return Codec.ZSTD


def _compressor(level: int, *, planes: bool = False) -> zstandard.ZstdCompressor:
    """A per-thread compressor. Byte planes get a small match table (``hash_log=8``): they
    compress by entropy coding, not long matches, so this is ~1.7x faster at the same ratio."""
    cache = getattr(_local, "compressors", None)
    if cache is None:
        cache = _local.compressors = {}
    key = (level, planes)
    if key not in cache:
        if planes:
            params = zstandard.ZstdCompressionParameters.from_level(level, hash_log=8)
            cache[key] = zstandard.ZstdCompressor(compression_params=params)
        else:
            cache[key] = zstandard.ZstdCompressor(level=level)
    return cache[key]


def _decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "decompressor", None)
    if d is None:
        d = _local.decompressor = zstandard.ZstdDecompressor()
    return d


def _compress_planes(raw: memoryview, group: int, level: int, min_saving: float) -> bytes:
    planes = np.frombuffer(raw, dtype=np.uint8).reshape(-1, group).T
    words, parts = [], []
    for plane in planes:
        data = plane.tobytes()
        packed = _compressor(level, planes=True).compress(data)
        if len(packed) <= len(data) * (1.0 - min_saving):
            words.append(len(packed) | _PLANE_ZSTD)
            parts.append(packed)
        else:
            words.append(len(data))
            parts.append(data)
    return struct.pack(f"<{group}I", *words) + b"".join(parts)


def _decompress_planes(stored: memoryview | bytes, group: int, raw_len: int) -> bytes:
    head = 4 * group
    if len(stored) < head:
        raise CorruptCheckpointError("byte-grouped frame is shorter than its plane table")
    words = struct.unpack_from(f"<{group}I", stored)
    out = np.empty((raw_len // group, group), dtype=np.uint8)
    pos = head
    for i, word in enumerate(words):
        n = word & ~_PLANE_ZSTD
        part = memoryview(stored)[pos : pos + n]
        if part.nbytes != n:
            raise CorruptCheckpointError("byte-grouped frame is shorter than its plane table says")
        pos += n
        if word & _PLANE_ZSTD:
            part = _decompress(part, raw_len // group)
        elif n != raw_len // group:
            raise CorruptCheckpointError(f"raw plane has {n} bytes, expected {raw_len // group}")
        out[:, i] = np.frombuffer(part, dtype=np.uint8)
    return out.tobytes()


def _decompress(stored: memoryview | bytes, raw_len: int) -> bytes:
    try:
        data = _decompressor().decompress(stored, max_output_size=raw_len)
    except zstandard.ZstdError as e:
        raise CorruptCheckpointError(f"zstd frame does not decode: {e}") from e
    if len(data) != raw_len:
        raise CorruptCheckpointError(f"zstd frame decodes to {len(data)} bytes, expected {raw_len}")
    return data


def encode_frame(
    raw: memoryview, codec: Codec, *, level: int, min_saving: float, digest: bytes | None = None
) -> tuple[memoryview | bytes, Codec, bytes]:
    """Hash (unless ``digest`` is already known) and encode one frame.

    Returns ``(stored bytes, codec actually used, hash)``.
    """
    if digest is None:
        digest = frame_hash(raw)
    if codec == Codec.RAW or raw.nbytes == 0:
        return raw, Codec.RAW, digest
    group = _BYTEGROUP.get(codec)
    if group is not None:
        packed = _compress_planes(raw, group, level, min_saving)
    else:
        packed = _compressor(level).compress(raw)
    if len(packed) > raw.nbytes * (1.0 - min_saving):
        return raw, Codec.RAW, digest
    return packed, codec, digest


def decode_frame(stored: memoryview | bytes, codec: int, raw_len: int) -> memoryview | bytes:
    """Decode one stored frame to its raw bytes; the caller verifies the hash."""
    if codec == Codec.RAW:
        if len(stored) != raw_len:
            raise CorruptCheckpointError(f"raw frame has {len(stored)} bytes, expected {raw_len}")
        return stored
    if codec == Codec.ZSTD:
        return _decompress(stored, raw_len)
    group = _BYTEGROUP.get(codec)  # type: ignore[call-overload]
    if group is None:
        raise CorruptCheckpointError(f"unknown frame codec {codec}")
    return _decompress_planes(stored, group, raw_len)
