"""Checkpoints on S3 end to end: ShardWriter/ShardReader against moto's HTTP server."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from shardstore.testing import run_ranks
from shardstore import ShardReader, ShardWriter, StorageError
from shardstore.config import INDEX_NAME
from shardstore.errors import unwrap_error

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

ROWS, COLS = 300, 500  # 600 KB of fp32 (+ a bf16 copy): several parts with 256 KiB frames


def _full() -> dict:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(ROWS, COLS, generator=g) * 0.02
    return {"w": w, "b16": w.bfloat16()}


def _save(url: str, storage_options: dict, compression) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    state = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in _full().items()}
    state["step"] = 42
    writer = ShardWriter(url, storage_options=storage_options, compression=compression, frame_size=256 << 10)
    dcp.save(state, storage_writer=writer)


def _load(url: str, storage_options: dict) -> bool:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    state = {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(1)]) for k, v in _full().items()}
    state["step"] = 0
    dcp.load(state, storage_reader=ShardReader(url, storage_options=storage_options))
    for k, v in _full().items():
        assert torch.equal(state[k].full_tensor(), v), k
    assert state["step"] == 42
    return True


def _load_single(url: str, storage_options: dict) -> None:
    state = {k: torch.zeros_like(v) for k, v in _full().items()}
    state["step"] = 0
    dcp.load(state, storage_reader=ShardReader(url, storage_options=storage_options))
    for k, v in _full().items():
        assert torch.equal(state[k], v), k
    assert state["step"] == 42


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_save_on_2_load_on_3_and_in_one_process(s3_url, compression):
    run_ranks(2, _save, s3_url.url, s3_url.storage_options, compression)
    assert any(k.endswith(INDEX_NAME) for k in s3_url.keys())
    assert run_ranks(3, _load, s3_url.url, s3_url.storage_options) == [True] * 3
    _load_single(s3_url.url, s3_url.storage_options)
    assert s3_url.open_uploads() == []


def test_save_and_load_complete_exactly_through_5_percent_faults(faulty_s3):
    run_ranks(2, _save, faulty_s3.url, faulty_s3.storage_options, "zstd")
    _load_single(faulty_s3.url, faulty_s3.storage_options)
    assert faulty_s3.proxy.faults > 0  # faults really happened, and were retried
    assert faulty_s3.direct.open_uploads() == []


def _save_expecting_failure(url: str, storage_options: dict) -> str:
    try:
        _save(url, storage_options, None)
    except BaseException as e:  # DCP's CheckpointException
        inner = unwrap_error(e)
        return f"{type(inner).__name__}: {inner}"
    return "saved"


def test_save_fails_cleanly_when_every_request_fails(faulty_s3):
    faulty_s3.proxy.set_faults(1.0)
    out = run_ranks(2, _save_expecting_failure, faulty_s3.url, faulty_s3.storage_options)
    for msg in out:
        assert msg.startswith(StorageError.__name__), msg
    faulty_s3.proxy.set_faults(0.0)
    assert not any(k.endswith(INDEX_NAME) for k in faulty_s3.direct.keys())
    assert faulty_s3.direct.open_uploads() == []


def test_large_files_go_up_as_parallel_multipart_uploads_and_read_back(s3_url, faulty_s3):
    from shardstore.backends.s3 import S3Backend

    full = torch.randn(3 * 1024 * 1024)  # 12 MiB in one data file: three 5 MiB parts at least
    backend = S3Backend(faulty_s3.url, storage_options=faulty_s3.storage_options, part_size=5 << 20, max_concurrency=3)
    dcp.save({"big": full}, storage_writer=ShardWriter(backend, threads=1))
    assert faulty_s3.proxy.max_inflight >= 2  # parts went up concurrently (through 5% faults)
    state = {"big": torch.zeros_like(full)}
    dcp.load(state, storage_reader=ShardReader(s3_url.url, storage_options=s3_url.storage_options))
    assert torch.equal(state["big"], full)
    assert s3_url.open_uploads() == []
