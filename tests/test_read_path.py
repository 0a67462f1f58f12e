"""The load path: raw frames read straight into the target tensors and verified there.

Covers whole and partial (resharded) spans with frame boundaries inside and at the edges of the
span, bf16 and fp32, targets that cannot take the bytes as they are (non-contiguous, another
dtype, a sub-box that is not one span: the staging path), frames shared by two read items,
compressed frames, a flipped byte in a frame read in place, missing and short data files, and the
backends' scatter reads (``FileReader.read_into``: POSIX ``preadv`` and ``RangeFileReader``'s
read-and-copy for fsspec/S3). Read items come from DCP's own
``create_read_items_for_chunk_list``, as its planner makes them for a resharded load; multi-rank
resharded loads through this path are in test_core_dist.py and test_compression.py.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import re

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

import shardstore.backends.posix as posix
from shardstore import CorruptCheckpointError, ShardReader, ShardWriter, TruncatedFileError
from shardstore.backends import Backend, open_backend
from shardstore.backends.base import FileReader, RangeFileReader
from shardstore.backends.posix import PosixBackend
from shardstore.codec import Codec
from shardstore.errors import unwrap_error
from shardstore.inspect import _BoxPlanner

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

FRAME = 4096
ROWS, COLS = 100, 56  # bf16 rows of 112 bytes, fp32 rows of 224: frames end mid-row


def _weights(dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(ROWS, COLS, generator=g) * 0.02).to(dtype)


def _state() -> dict:
    return {"bf16": _weights(torch.bfloat16, 1), "fp32": _weights(torch.float32, 2), "step": 3}


def _save(path: str, compression: str | None = None, state: dict | None = None) -> str:
    writer = ShardWriter(path, frame_size=FRAME, threads=1, sync=False, compression=compression)
    dcp.save(state or _state(), storage_writer=writer, no_dist=True)
    return path


@pytest.fixture
def ckpt(tmp_path) -> str:
    return _save(str(tmp_path / "raw"))


class _Recording(PosixBackend):
    """A POSIX backend that records the buffers of every scatter read (address, length)."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.buffers: list[tuple[int, int]] = []

    def open_reader(self, path: str) -> FileReader:
        inner = super().open_reader(path)
        buffers = self.buffers

        class Recording(FileReader):
            def read_into(self, start, bufs):
                buffers.extend((ctypes.addressof(ctypes.c_char.from_buffer(b)), b.nbytes) for b in bufs)
                inner.read_into(start, bufs)

            def close(self):
                inner.close()

        return Recording()


def _bytes_inside(buffers: list[tuple[int, int]], t: torch.Tensor) -> int:
    lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    return sum(n for addr, n in buffers if lo <= addr and addr + n <= hi)


class _CommitLog(_BoxPlanner):
    """shardstore's box planner (``dest_index.index`` picks the target), recording the commits."""

    def __init__(self, targets: list[torch.Tensor]) -> None:
        super().__init__(targets)
        self.committed: list[ReadItem] = []

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        self.committed.append(read_item)


def _load_boxes(reader: ShardReader, boxes: list[tuple[str, tuple[int, ...], tuple[int, ...]]],
                targets: list[torch.Tensor]) -> _CommitLog:
    """Load sub-boxes ``(fqn, offsets, sizes)`` of stored tensors into ``targets`` (one each)."""
    md = reader.read_metadata().state_dict_metadata
    items = []
    for i, (fqn, offsets, sizes) in enumerate(boxes):
        local = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
        for item in create_read_items_for_chunk_list(fqn, md[fqn], [local]):
            items.append(dataclasses.replace(item, dest_index=MetadataIndex(fqn, offsets, i)))
    planner = _CommitLog(targets)
    reader.read_data(LoadPlan(items), planner).wait()
    assert len(planner.committed) == len(items)
    return planner


def _frame_bytes(reader: ShardReader, fqn: str, a: int, b: int) -> int:
    """Stored bytes of the frames that hold raw bytes [a, b) of ``fqn``'s only chunk."""
    t = reader.index.tensors[fqn]
    g0, g1 = a // FRAME, (b - 1) // FRAME + 1
    return int(t.frame_len[g0:g1].sum())


# --------------------------------------------------------------------------- whole spans


@pytest.mark.parametrize("threads", [1, 3])
def test_whole_tensors_are_read_into_the_targets(ckpt, threads):
    backend = _Recording(ckpt)
    target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in _state().items()}
    dcp.load(target, storage_reader=ShardReader(backend, threads=threads, max_range=3 * FRAME), no_dist=True)
    want = _state()
    for k in ("bf16", "fp32"):
        assert torch.equal(target[k], want[k]), k
        # every byte of the tensor went straight into its memory: no scratch, no staging
        assert _bytes_inside(backend.buffers, target[k]) == target[k].numel() * target[k].element_size(), k
    assert target["step"] == 3


# --------------------------------------------------------------------------- partial spans


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize(
    "rows",
    [
        (0, ROWS),
        (10, 60),  # both ends mid-frame
        (0, 37),  # starts at a frame boundary, ends mid-frame
        (37, ROWS),  # starts mid-frame, ends with the tensor
        (5, 9),  # inside one frame
        (30, 31),  # a single row
    ],
)
def test_partial_spans_read_only_their_frames(ckpt, dtype, rows):
    r0, r1 = rows
    reader = ShardReader(_Recording(ckpt))
    want = _state()[dtype][r0:r1]
    target = torch.full_like(want, 7.0)
    _load_boxes(reader, [(dtype, (r0, 0), (r1 - r0, COLS))], [target])
    assert torch.equal(target, want)
    row = COLS * want.element_size()
    assert reader.bytes_read == _frame_bytes(reader, dtype, r0 * row, r1 * row)
    # frames wholly inside the span land in the target; only the partial end frames do not
    whole = max(0, ((r1 * row) // FRAME) - (-(-r0 * row // FRAME))) * FRAME
    assert _bytes_inside(reader.backend.buffers, target) >= whole


def test_a_frame_shared_by_two_read_items_is_read_once(ckpt):
    reader = ShardReader(_Recording(ckpt))
    want = _state()["fp32"]
    first, second = torch.zeros(25, COLS), torch.zeros(40, COLS)  # split at row 25: mid-frame
    _load_boxes(reader, [("fp32", (0, 0), (25, COLS)), ("fp32", (25, 0), (40, COLS))], [first, second])
    assert torch.equal(first, want[:25]) and torch.equal(second, want[25:65])
    assert reader.bytes_read == _frame_bytes(reader, "fp32", 0, 65 * COLS * 4)


# --------------------------------------------------------------------------- staging path


def test_non_contiguous_target_takes_the_copy_path(ckpt):
    reader = ShardReader(_Recording(ckpt))
    want = _state()["bf16"][10:70]
    target = torch.zeros(COLS, 60, dtype=torch.bfloat16).t()  # a transposed view
    _load_boxes(reader, [("bf16", (10, 0), (60, COLS))], [target])
    assert torch.equal(target, want)
    assert _bytes_inside(reader.backend.buffers, target) == 0


def test_sub_box_that_is_not_one_span_takes_the_copy_path(ckpt):
    reader = ShardReader(ckpt)
    want = _state()["fp32"][20:50, 8:24]
    target = torch.zeros(30, 16)
    _load_boxes(reader, [("fp32", (20, 8), (30, 16))], [target])
    assert torch.equal(target, want)


@pytest.mark.parametrize("rows", [(0, ROWS), (13, 71)])
def test_bf16_checkpoint_into_fp32_target(ckpt, rows):
    r0, r1 = rows
    reader = ShardReader(ckpt)
    target = torch.zeros(r1 - r0, COLS, dtype=torch.float32)
    _load_boxes(reader, [("bf16", (r0, 0), (r1 - r0, COLS))], [target])
    assert torch.equal(target, _state()["bf16"][r0:r1].float())


# --------------------------------------------------------------------------- compression


@pytest.mark.parametrize("rows", [(0, ROWS), (11, 83)])
def test_compressed_frames(tmp_path, rows):
    r0, r1 = rows
    state = {"bf16": _weights(torch.bfloat16, 1), "ids": torch.arange(ROWS * COLS).reshape(ROWS, COLS) % 5}
    path = _save(str(tmp_path / "zstd"), "zstd", state)
    reader = ShardReader(path)
    codecs = {int(c) for t in reader.index.tensors.values() for c in t.frame_codec}
    assert codecs & {Codec.ZSTD, Codec.ZSTD_BYTEGROUP2}, codecs
    targets = [torch.zeros(r1 - r0, COLS, dtype=torch.bfloat16), torch.zeros(r1 - r0, COLS, dtype=torch.int64)]
    _load_boxes(reader, [("bf16", (r0, 0), (r1 - r0, COLS)), ("ids", (r0, 0), (r1 - r0, COLS))], targets)
    assert torch.equal(targets[0], state["bf16"][r0:r1])
    assert torch.equal(targets[1], state["ids"][r0:r1])


# --------------------------------------------------------------------------- corruption


def _data_file(ckpt: str) -> str:
    (name,) = [f for f in os.listdir(ckpt) if f.startswith("data-")]
    return name


def _flip(ckpt: str, fqn: str, raw_offset: int) -> int:
    """Flip one byte of ``fqn``'s raw bytes at ``raw_offset`` in the data file; return its file offset."""
    t = ShardReader(ckpt).index.tensors[fqn]
    assert all(int(c) == Codec.RAW for c in t.frame_codec)
    offset = int(t.frame_pos[raw_offset // FRAME]) + raw_offset % FRAME
    path = os.path.join(ckpt, _data_file(ckpt))
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))
    return offset


def _check_message(err: CorruptCheckpointError, ckpt: str, fqn: str, offset: int) -> None:
    msg = str(err)
    assert "checksum" in msg and ckpt in msg and _data_file(ckpt) in msg and repr(fqn) in msg, msg
    m = re.search(r"bytes \[(\d+), (\d+)\)", msg)
    assert m and int(m.group(1)) <= offset < int(m.group(2)), msg


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_flipped_byte_in_a_frame_read_in_place_is_caught(ckpt, dtype):
    offset = _flip(ckpt, dtype, FRAME + 100)  # inside the second frame, read straight into the target
    target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in _state().items()}
    with pytest.raises(BaseException) as info:  # DCP wraps it in a CheckpointException
        dcp.load(target, storage_reader=ShardReader(ckpt), no_dist=True)
    err = unwrap_error(info.value)
    assert isinstance(err, CorruptCheckpointError), repr(err)
    _check_message(err, ckpt, dtype, offset)


def test_flipped_byte_in_a_partial_frame_is_caught(ckpt):
    row = COLS * 4
    offset = _flip(ckpt, "fp32", 10 * row - 8)  # in the frame holding row 10, outside rows 10..
    reader = ShardReader(ckpt)
    with pytest.raises(CorruptCheckpointError) as info:
        _load_boxes(reader, [("fp32", (10, 0), (30, COLS))], [torch.zeros(30, COLS)])
    _check_message(info.value, ckpt, "fp32", offset)


def test_verify_off_reads_the_stored_bytes(ckpt):
    _flip(ckpt, "fp32", 0)
    target = torch.zeros(ROWS, COLS)
    _load_boxes(ShardReader(ckpt, verify=False), [("fp32", (0, 0), (ROWS, COLS))], [target])
    want = _state()["fp32"]
    assert torch.equal(target[1:], want[1:]) and not torch.equal(target[0], want[0])


# --------------------------------------------------------------------------- backends


def test_fsspec_backend_reads_through_the_copying_default(tmp_path):
    url = f"memory://{tmp_path.name}-read-path/c"
    _save(url)
    assert type(open_backend(url)).open_reader is Backend.open_reader  # reads ranges, then copies
    target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in _state().items()}
    dcp.load(target, storage_reader=ShardReader(url), no_dist=True)
    want = _state()
    assert torch.equal(target["bf16"], want["bf16"]) and torch.equal(target["fp32"], want["fp32"])
    part = torch.zeros(41, COLS)
    _load_boxes(ShardReader(url), [("fp32", (17, 0), (41, COLS))], [part])
    assert torch.equal(part, want["fp32"][17:58])


@pytest.mark.parametrize("impl", ["posix", "ranges"])
def test_scatter_reads_fill_the_buffers_and_refuse_short_files(tmp_path, monkeypatch, impl):
    data = os.urandom(10_000)
    (tmp_path / "f.bin").write_bytes(data)
    backend = PosixBackend(str(tmp_path))
    opened = backend.open_reader if impl == "posix" else lambda p: RangeFileReader(backend, p)
    monkeypatch.setattr(posix, "IOV_MAX", 3)  # several preadv calls per read
    sizes = [1, 0, 700, 4096, 13, 2000, 5]
    bufs = [np.zeros(n, dtype=np.uint8) for n in sizes]
    with opened("f.bin") as f:
        f.read_into(123, [memoryview(b) for b in bufs])
        assert b"".join(b.tobytes() for b in bufs) == data[123 : 123 + sum(sizes)]
        with pytest.raises(TruncatedFileError, match="truncated"):
            f.read_into(9_000, [memoryview(np.zeros(600, dtype=np.uint8)), memoryview(np.zeros(600, dtype=np.uint8))])
    with pytest.raises(FileNotFoundError):
        with opened("missing.bin") as f:
            f.read_into(0, [memoryview(np.zeros(4, dtype=np.uint8))])


def test_missing_and_short_data_files_are_named(ckpt):
    name = _data_file(ckpt)
    path = os.path.join(ckpt, name)
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
    with pytest.raises(TruncatedFileError, match=f"data file {name} of checkpoint {re.escape(ckpt)} is truncated"):
        _load_boxes(ShardReader(ckpt), [("fp32", (0, 0), (ROWS, COLS)), ("bf16", (0, 0), (ROWS, COLS))],
                    [torch.zeros(ROWS, COLS), torch.zeros(ROWS, COLS, dtype=torch.bfloat16)])
    os.unlink(path)
    with pytest.raises(CorruptCheckpointError, match=f"data file {name} of checkpoint {re.escape(ckpt)} is missing"):
        _load_boxes(ShardReader(ckpt), [("fp32", (0, 0), (ROWS, COLS))], [torch.zeros(ROWS, COLS)])


class _LargeReads(PosixBackend):
    """Local files read like an object store: through ``read_ranges``, which records each read,
    with ``read_size`` as the store's preferred read."""

    def __init__(self, root: str, read_size: int | None) -> None:
        super().__init__(root, sync=False)
        self.read_size = read_size
        self.reads: list[int] = []

    def open_reader(self, path: str) -> FileReader:
        return RangeFileReader(self, path)

    def read_ranges(self, path, ranges):
        self.reads.extend(length for _, length in ranges)
        return super().read_ranges(path, ranges)


def test_a_store_that_wants_large_reads_gets_runs_of_its_read_size(tmp_path):
    # 4 tensors of 100 x 56 fp32 (21.9 KiB each, 6 frames) in one file: with max_range of one
    # frame every frame is its own read, unless the store asks for more.
    state = {f"t{i}": torch.randn(ROWS, COLS) for i in range(4)}
    path = _save(str(tmp_path / "c"), state=state)
    for read_size, most_reads in ((None, None), (64 << 10, 2)):
        store = _LargeReads(path, read_size)
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        dcp.load(target, storage_reader=ShardReader(store, max_range=FRAME), no_dist=True)
        assert all(torch.equal(target[k], state[k]) for k in state)
        if most_reads is None:
            assert max(store.reads) <= FRAME and len(store.reads) >= 4 * 6, store.reads
        else:
            assert len(store.reads) <= most_reads and max(store.reads) > FRAME, store.reads
