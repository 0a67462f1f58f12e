"""Compression with random access: exact round trips, codec choice, and resharded loads that
read only the frames they need (bytes read measured against the index's frame table)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from shardstore.testing import run_ranks
from shardstore import ShardReader, ShardWriter
from shardstore.codec import Codec, decode_frame, encode_frame, frame_hash
from shardstore.reader import MERGE_GAP

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

FRAME = 4096  # the smallest frame size: many frames from small tensors


def _weights(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 0.02).to(dtype)


def _state() -> dict:
    g = torch.Generator().manual_seed(1)
    big = torch.randn(40, 300, generator=g, dtype=torch.float64)
    return {
        "bf16": _weights((96, 200), torch.bfloat16, 2),  # 9 frames, last one short
        "fp16": _weights((50, 70), torch.float16, 3),
        "fp32": _weights((33, 129), torch.float32, 4),  # odd sizes: frames cut mid-row
        "specials": torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-45] * 500),
        "fp64": big,
        "int64": torch.randint(-(2**62), 2**62, (3000,), generator=g),
        "int64_small": torch.arange(5000) % 7,  # compresses very well
        "bool": torch.rand(5000, generator=g) > 0.3,
        "int8": torch.randint(-128, 128, (777,), generator=g, dtype=torch.int8),
        "empty": torch.empty(0, 16),
        "empty_bf16": torch.empty(4, 0, dtype=torch.bfloat16),
        "scalar": torch.tensor(2.5, dtype=torch.float32),
        "scalar_bf16": torch.tensor(-1.25, dtype=torch.bfloat16),
        "scalar_int": torch.tensor(7),
        "transposed": _weights((120, 90), torch.float32, 5).t(),  # non-contiguous sources
        "strided": _weights((64, 256), torch.bfloat16, 6)[::2, 3::3],
        "expanded": torch.arange(64, dtype=torch.float32).expand(50, 64),
        "zeros": torch.zeros(20000, dtype=torch.float32),
        "step": 12,
    }


def _zeros_like(state: dict) -> dict:
    return {k: torch.zeros_like(v, memory_format=torch.contiguous_format) if isinstance(v, torch.Tensor) else 0
            for k, v in state.items()}


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_round_trip_is_exact_for_every_dtype_and_layout(tmp_path, compression):
    state = _state()
    path = str(tmp_path / "c")
    dcp.save(state, storage_writer=ShardWriter(path, compression=compression, frame_size=FRAME, sync=False))
    out = _zeros_like(state)
    out["transposed"] = torch.zeros(120, 90).t()  # load into a non-contiguous target too
    dcp.load(out, storage_reader=ShardReader(path))
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            assert out[k].dtype == v.dtype and out[k].shape == v.shape, k
            assert torch.equal(out[k], v) or k == "specials", k  # NaN != NaN
            # bit-exact, not merely equal (-0.0 vs 0.0, NaN payloads)
            a, b = out[k].reshape(-1), v.reshape(-1)
            assert a.view(torch.uint8).equal(b.view(torch.uint8)), k
    assert out["step"] == 12

    index = ShardReader(path).index
    for k, t in index.tensors.items():
        raw = t.raw_nbytes(0)
        assert len(t.frame_len) == -(-raw // FRAME), k  # frames are cut at frame_size
        if compression is None:
            assert set(t.frame_codec.tolist()) <= {Codec.RAW}, k
            sizes = [min(FRAME, raw - i * FRAME) for i in range(len(t.frame_len))]
            assert t.frame_len.tolist() == sizes, k


def test_codec_choice_and_raw_fallback_are_in_the_index(tmp_path):
    state = _state()
    path = str(tmp_path / "c")
    dcp.save(state, storage_writer=ShardWriter(path, compression="zstd", frame_size=FRAME, sync=False))
    t = ShardReader(path).index.tensors
    assert set(t["bf16"].frame_codec.tolist()) == {Codec.ZSTD_BYTEGROUP2}
    assert set(t["fp16"].frame_codec.tolist()) == {Codec.ZSTD_BYTEGROUP2}
    assert set(t["fp32"].frame_codec.tolist()) == {Codec.ZSTD_BYTEGROUP4}
    assert set(t["zeros"].frame_codec.tolist()) == {Codec.ZSTD_BYTEGROUP4}
    assert set(t["int64_small"].frame_codec.tolist()) == {Codec.ZSTD}
    # random 62-bit integers do not shrink by min_saving: stored raw, byte for byte
    assert set(t["int64"].frame_codec.tolist()) == {Codec.RAW}
    assert t["int64"].stored_nbytes() == 3000 * 8
    assert t["bf16"].stored_nbytes() < 0.75 * t["bf16"].raw_nbytes(0)
    assert t["zeros"].stored_nbytes() < 0.05 * t["zeros"].raw_nbytes(0)
    assert len(t["empty"].frame_len) == 0 and len(t["scalar"].frame_len) == 1


@pytest.mark.parametrize(
    "dtype, codec",
    [
        (torch.bfloat16, Codec.ZSTD_BYTEGROUP2),
        (torch.float16, Codec.ZSTD_BYTEGROUP2),
        (torch.float32, Codec.ZSTD_BYTEGROUP4),
        (torch.float64, Codec.ZSTD),
    ],
)
def test_frame_codec_round_trip_and_plane_table(dtype, codec):
    raw = memoryview(_weights((1000,), dtype, 7).view(torch.uint8).numpy())
    stored, used, digest = encode_frame(raw, codec, level=1, min_saving=0.03)
    assert used == codec and digest == frame_hash(raw)
    assert bytes(decode_frame(stored, used, raw.nbytes)) == raw.tobytes()
    if codec in (Codec.ZSTD_BYTEGROUP2, Codec.ZSTD_BYTEGROUP4):
        group = 2 if codec == Codec.ZSTD_BYTEGROUP2 else 4
        words = np.frombuffer(bytes(stored[: 4 * group]), dtype="<u4")
        lengths, zstd = words & 0x7FFFFFFF, words >> 31
        assert int(lengths.sum()) + 4 * group == len(stored)
        # the top byte (sign + exponent) compresses; the lowest mantissa byte does not and stays raw
        assert zstd[-1] == 1 and lengths[-1] < raw.nbytes // group
        assert zstd[0] == 0 and lengths[0] == raw.nbytes // group


def test_incompressible_frame_is_stored_raw():
    raw = memoryview(np.random.default_rng(0).integers(0, 256, 8192, dtype=np.uint8).tobytes())
    for codec in (Codec.ZSTD, Codec.ZSTD_BYTEGROUP2, Codec.ZSTD_BYTEGROUP4):
        stored, used, _ = encode_frame(raw, codec, level=1, min_saving=0.03)
        assert used == Codec.RAW and bytes(stored) == raw.tobytes()


def test_partial_load_reads_only_the_frames_of_the_requested_tensor(tmp_path):
    state = {f"layer{i}": _weights((64, 512), torch.bfloat16, i) for i in range(4)}
    path = str(tmp_path / "c")
    dcp.save(state, storage_writer=ShardWriter(path, compression="zstd", frame_size=FRAME, threads=1, sync=False))
    reader = ShardReader(path)
    out = {"layer2": torch.zeros(64, 512, dtype=torch.bfloat16)}
    dcp.load(out, storage_reader=reader)
    assert torch.equal(out["layer2"], state["layer2"])
    assert reader.bytes_read == reader.index.tensors["layer2"].stored_nbytes()


# -- resharding 2 -> 3 ranks from a compressed checkpoint --------------------------------------

ROWS, COLS = 100, 256  # 100 rows: 50/50 on 2 ranks, 34/34/32 on 3


def _full(name: str) -> torch.Tensor:
    dtype = {"wb": torch.bfloat16, "wf": torch.float32}[name]
    return _weights((ROWS, COLS), dtype, seed=11 if name == "wb" else 12)


def _save_sharded(path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    state = {k: distribute_tensor(_full(k), mesh, [Shard(0)]) for k in ("wb", "wf")}
    state["step"] = 5
    dcp.save(state, storage_writer=ShardWriter(path, compression="zstd", frame_size=FRAME, threads=1, sync=False))


def _load_sharded(path: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    state = {k: distribute_tensor(torch.zeros_like(_full(k)), mesh, [Shard(0)]) for k in ("wb", "wf")}
    state["step"] = 0
    reader = ShardReader(path)
    dcp.load(state, storage_reader=reader)
    rows = {}
    for k in ("wb", "wf"):
        local = state[k].to_local()
        r0 = state[k].placements[0]._local_shard_size_and_offset(ROWS, dist.get_world_size(), dist.get_rank())[1]
        assert torch.equal(local, _full(k)[r0 : r0 + local.shape[0]]), (k, dist.get_rank())
        rows[k] = (r0, r0 + local.shape[0])
    assert state["step"] == 5
    return {"rows": rows, "bytes_read": reader.bytes_read}


def _needed_frames(index, fqn: str, r0: int, r1: int) -> dict[int, list[tuple[int, int]]]:
    """Per data file, the (start, end) byte ranges of the frames holding rows [r0, r1)."""
    t = index.tensors[fqn]
    fs, row = index.frame_size, COLS * t.itemsize
    pos = t.frame_pos
    out: dict[int, list[tuple[int, int]]] = {}
    for c in range(len(t.pos)):
        c0 = int(t.offsets[c][0])
        c1 = c0 + int(t.sizes[c][0])
        lo, hi = max(r0, c0), min(r1, c1)
        if lo >= hi:
            continue
        a, b = (lo - c0) * row, (hi - c0) * row
        base = int(t.frame_start[c])
        for g in range(base + a // fs, base + (b - 1) // fs + 1):
            out.setdefault(int(t.file[c]), []).append((int(pos[g]), int(pos[g] + t.frame_len[g])))
    return out


def test_resharded_load_2_to_3_reads_only_the_needed_frames(tmp_path):
    path = str(tmp_path / "c")
    run_ranks(2, _save_sharded, path)
    index = ShardReader(path).index
    assert all(len(t.pos) == 2 and len(t.frame_len) > 8 for t in index.tensors.values())
    assert {int(c) for t in index.tensors.values() for c in t.frame_codec} <= {
        Codec.ZSTD_BYTEGROUP2, Codec.ZSTD_BYTEGROUP4}

    results = run_ranks(3, _load_sharded, path)
    total = index.stored_nbytes()
    for rank, res in enumerate(results):
        ranges: dict[int, list[tuple[int, int]]] = {}
        for fqn, (r0, r1) in res["rows"].items():
            for fid, rs in _needed_frames(index, fqn, r0, r1).items():
                ranges.setdefault(fid, []).extend(rs)
        needed = sum(e - s for rs in ranges.values() for s, e in set(rs))
        # runs of needed frames that are not adjacent in their file: the reader may bridge each
        # gap of at most MERGE_GAP bytes (record padding), and never reads anything else
        runs = 0
        for rs in ranges.values():
            end = -1
            for s, e in sorted(set(rs)):
                runs += s != end
                end = e
        assert needed <= res["bytes_read"] <= needed + MERGE_GAP * runs, (rank, res["bytes_read"], needed)
        assert res["bytes_read"] < 0.45 * total, (rank, res["bytes_read"], total)
