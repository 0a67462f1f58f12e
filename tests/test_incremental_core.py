"""Writer/reader side of incremental saves: unchanged chunks are referenced, not rewritten."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from shardstore.testing import run_ranks
from shardstore import CorruptCheckpointError, ShardReader, ShardWriter
from shardstore.errors import unwrap_error
from shardstore.reader import load_index
from shardstore.backends import open_backend

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _state(step: int) -> dict:
    torch.manual_seed(0)
    frozen = {f"frozen{i}": torch.randn(256, 64) for i in range(4)}
    torch.manual_seed(step)
    return {**frozen, "lora": torch.randn(8, 64), "step": step}


def _data_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.startswith("data-"))


def test_second_save_writes_only_changed_chunks_and_every_step_loads(tmp_path):
    root = tmp_path
    dcp.save(_state(1), storage_writer=ShardWriter(str(root / "step-1"), compression="zstd"))
    dcp.save(_state(2), storage_writer=ShardWriter(str(root / "step-2"), compression="zstd", incremental_base="step-1"))
    dcp.save(_state(3), storage_writer=ShardWriter(str(root / "step-3"), compression="zstd", incremental_base="step-2"))
    lora_bytes = 8 * 64 * 4
    assert _data_bytes(str(root / "step-2")) <= lora_bytes + 64
    assert _data_bytes(str(root / "step-3")) <= lora_bytes + 64
    index = load_index(open_backend(str(root / "step-3")))
    # references point straight at the file holding the bytes: step-1's, never through step-2
    assert sorted({f.base for f in index.files}, key=str) == [None, "step-1"]
    for step in (1, 2, 3):
        target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in _state(step).items()}
        dcp.load(target, storage_reader=ShardReader(str(root / f"step-{step}")))
        for k, v in _state(step).items():
            assert torch.equal(target[k], v) if isinstance(v, torch.Tensor) else target[k] == v


def test_corrupted_referenced_file_is_reported_against_the_loading_step(tmp_path):
    dcp.save(_state(1), storage_writer=ShardWriter(str(tmp_path / "step-1")))
    dcp.save(_state(2), storage_writer=ShardWriter(str(tmp_path / "step-2"), incremental_base="step-1"))
    f = next(p for p in os.listdir(tmp_path / "step-1") if p.startswith("data-"))
    with open(tmp_path / "step-1" / f, "r+b") as fh:
        fh.seek(200)
        fh.write(b"\xff\xff")
    target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in _state(2).items()}
    with pytest.raises(BaseException) as info:
        dcp.load(target, storage_reader=ShardReader(str(tmp_path / "step-2")))
    err = unwrap_error(info.value)
    assert isinstance(err, CorruptCheckpointError)
    assert "step-2" in str(err) and f"../step-1/{f}" in str(err) and "checksum" in str(err)


def _save_dtensor(root: str, name: str, base: str | None, scale: float) -> int:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    frozen = torch.arange(96 * 40, dtype=torch.float32).reshape(96, 40)
    state = {"frozen": distribute_tensor(frozen, mesh, [Shard(0)]),
             "trained": distribute_tensor(torch.full((12, 40), scale), mesh, [Shard(0)])}
    writer = ShardWriter(os.path.join(root, name), incremental_base=base)
    dcp.save(state, storage_writer=writer)
    return writer.bytes_written


def _load_dtensor(root: str, name: str, scale: float) -> bool:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    state = {"frozen": distribute_tensor(torch.zeros(96, 40), mesh, [Shard(0)]),
             "trained": distribute_tensor(torch.zeros(12, 40), mesh, [Shard(0)])}
    dcp.load(state, storage_reader=ShardReader(os.path.join(root, name)))
    assert torch.equal(state["frozen"].full_tensor(), torch.arange(96 * 40, dtype=torch.float32).reshape(96, 40))
    assert torch.equal(state["trained"].full_tensor(), torch.full((12, 40), scale))
    return True


def test_incremental_checkpoint_saved_on_2_restores_on_3(tmp_path):
    run_ranks(2, _save_dtensor, str(tmp_path), "step-1", None, 1.0)
    added = run_ranks(2, _save_dtensor, str(tmp_path), "step-2", "step-1", 2.0)
    assert sum(added) == 12 * 40 * 4  # only the trained tensor was written
    assert run_ranks(3, _load_dtensor, str(tmp_path), "step-2", 2.0) == [True] * 3
