"""Multi-rank save/load through ShardWriter/ShardReader: FSDP2, FSDP1, DTensor, world-size changes."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from shardstore.testing import run_ranks
from states import Net, assert_same_state
from shardstore import CheckpointExistsError, ShardReader, ShardWriter
from shardstore.config import INDEX_NAME


def _fsdp2_model(seed: int) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = Net()
    fully_shard(model)
    return model


def _train_one_step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    torch.manual_seed(123)
    model(torch.randint(0, 10, (4, 5))).backward()
    opt.step()
    opt.zero_grad()


def _full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """Unsharded model + optimizer state on CPU (every rank gets it)."""
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"model": msd, "optim": osd}


def _save_fsdp2(path: str, **writer_options) -> dict:
    model = _fsdp2_model(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    _train_one_step(model, opt)
    _train_one_step(model, opt)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "extra": {"step": 2, "epoch": 1, "tag": "run-a", "lrs": [0.01, 0.02]}}
    dcp.save(state, storage_writer=ShardWriter(path, **writer_options))
    full = _full_state(model, opt)
    return full if dist.get_rank() == 0 else {}


def _load_fsdp2(path: str) -> dict:
    model = _fsdp2_model(seed=1)  # different initial values: everything must come from the checkpoint
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "extra": {"step": 0, "epoch": 0, "tag": "", "lrs": []}}
    reader = ShardReader(path)
    dcp.load(state, storage_reader=reader)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    full = _full_state(model, opt)
    return {"full": full if dist.get_rank() == 0 else {}, "extra": state["extra"], "bytes_read": reader.bytes_read}


EXTRA = {"step": 2, "epoch": 1, "tag": "run-a", "lrs": [0.01, 0.02]}


@pytest.fixture(scope="module")
def saved_on_4(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ckpt") / "step-4")
    ref = run_ranks(4, _save_fsdp2, path)[0]
    return path, ref


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_fsdp2_save_on_4_load_on_n(saved_on_4, world_size):
    path, ref = saved_on_4
    out = run_ranks(world_size, _load_fsdp2, path)
    assert_same_state(ref, out[0]["full"])
    assert ref["optim"]["state"]["l1.weight"]["step"].item() == 2.0
    for r in out:
        assert r["extra"] == EXTRA


def test_fsdp2_save_on_2_load_on_4(tmp_path):
    path = str(tmp_path / "c")
    ref = run_ranks(2, _save_fsdp2, path)[0]
    out = run_ranks(4, _load_fsdp2, path)
    assert_same_state(ref, out[0]["full"])


def _save_rows(path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = torch.arange(512 * 256, dtype=torch.float32).reshape(512, 256)
    dcp.save({"w": distribute_tensor(full, mesh, [Shard(0)])}, storage_writer=ShardWriter(path, frame_size=64 << 10))


def _load_rows(path: str) -> int:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    state = {"w": distribute_tensor(torch.zeros(512, 256), mesh, [Shard(0)])}
    reader = ShardReader(path)
    dcp.load(state, storage_reader=reader)
    assert torch.equal(state["w"].full_tensor(), torch.arange(512 * 256, dtype=torch.float32).reshape(512, 256))
    return reader.bytes_read


def test_resharded_load_2_to_4_reads_each_byte_about_once(tmp_path):
    path = str(tmp_path / "c")
    run_ranks(2, _save_rows, path)
    per_rank = run_ranks(4, _load_rows, path)
    stored = 512 * 256 * 4
    assert sum(per_rank) / stored <= 1.05, per_rank
    assert all(abs(b - stored / 4) <= 64 << 10 for b in per_rank), per_rank


def test_fsdp2_save_on_3_load_in_one_process_without_process_group(tmp_path):
    path = str(tmp_path / "c")
    ref = run_ranks(3, _save_fsdp2, path, compression="zstd")[0]
    assert not dist.is_initialized()
    torch.manual_seed(5)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "extra": {"step": 0, "epoch": 0, "tag": "", "lrs": []}}
    dcp.load(state, storage_reader=ShardReader(path))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    full = {"model": model.state_dict(), "optim": get_state_dict(model, opt)[1]}
    assert_same_state(ref["model"], full["model"])
    assert_same_state(ref["optim"], full["optim"])
    assert state["extra"] == EXTRA


# -- FSDP1 ShardedTensor -> FSDP2 ----------------------------------------------------------------


def _fsdp1_sharded_state_dict(model: nn.Module) -> dict:
    """The state FSDP1's SHARDED_STATE_DICT produces: each parameter a ShardedTensor in dim-0 chunks.

    FSDP1 itself needs an accelerator in torch 2.13, so on CPU ranks the same ShardedTensors are
    built directly (row chunks of ceil(rows / world) rows, the last one shorter or empty).
    """
    from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for name, full in model.state_dict().items():
        rows = -(-full.shape[0] // world)
        start = min(rank * rows, full.shape[0])
        local = full[start : start + rows].clone()
        shards = [Shard.from_tensor_and_offsets(local, [start] + [0] * (full.dim() - 1), rank)] if local.numel() else []
        out[name] = init_from_local_shards(shards, full.shape)
    return out


def _save_fsdp1(path: str) -> dict:
    torch.manual_seed(0)
    sd = _fsdp1_sharded_state_dict(Net())
    assert all(type(v).__name__ == "ShardedTensor" for v in sd.values())
    dcp.save({"model": sd}, storage_writer=ShardWriter(path))
    torch.manual_seed(0)
    return {k: v.clone() for k, v in Net().state_dict().items()} if dist.get_rank() == 0 else {}


def _load_fsdp2_model_only(path: str) -> dict:
    model = _fsdp2_model(seed=7)
    sd = get_model_state_dict(model)
    dcp.load({"model": sd}, storage_reader=ShardReader(path))
    set_model_state_dict(model, sd)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return full if dist.get_rank() == 0 else {}


def test_fsdp1_sharded_state_dict_loads_into_fsdp2_on_another_world_size(tmp_path):
    path = str(tmp_path / "c")
    ref = run_ranks(2, _save_fsdp1, path)[0]
    got = run_ranks(3, _load_fsdp2_model_only, path)[0]
    assert_same_state(ref, got)


# -- 2-D DTensor resharding ------------------------------------------------------------------------


def _full_2d() -> torch.Tensor:
    return torch.arange(10 * 7, dtype=torch.float32).reshape(10, 7) / 7  # uneven on every mesh dim


def _save_2d(path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2))
    dt = distribute_tensor(_full_2d(), mesh, [Shard(0), Shard(1)])
    dcp.save({"w": dt, "b16": distribute_tensor(_full_2d().bfloat16(), mesh, [Shard(1), Shard(0)])},
             storage_writer=ShardWriter(path, compression="zstd"))


def _load_2d(path: str, placement: str) -> bool:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    place = {"shard1": [Shard(1)], "replicate": [Replicate()]}[placement]
    w = distribute_tensor(torch.zeros(10, 7), mesh, place)
    b16 = distribute_tensor(torch.zeros(10, 7), mesh, place)  # fp32 target of a bf16 checkpoint
    state = {"w": w, "b16": b16}
    dcp.load(state, storage_reader=ShardReader(path))
    assert torch.equal(state["w"].full_tensor(), _full_2d())
    assert torch.equal(state["b16"].full_tensor(), _full_2d().bfloat16().float())
    return True


def test_2d_dtensor_reshards_to_1d_and_replicated_on_3_ranks(tmp_path):
    path = str(tmp_path / "c")
    run_ranks(4, _save_2d, path)
    assert run_ranks(3, _load_2d, path, "shard1") == [True] * 3
    assert run_ranks(3, _load_2d, path, "replicate") == [True] * 3


# -- failures --------------------------------------------------------------------------------------


class _NotStorable:
    pass


def _save_failing_on_rank_1(path: str) -> str:
    state = {"w": torch.ones(4) * dist.get_rank()}
    if dist.get_rank() == 1:
        state["rank1_only"] = _NotStorable()
    try:
        dcp.save(state, storage_writer=ShardWriter(path))
    except BaseException as e:  # DCP raises CheckpointException (a BaseException) on every rank
        return f"{type(e).__name__}: {e}"
    return "saved"


def test_a_failing_rank_fails_the_save_on_every_rank_and_leaves_no_index(tmp_path):
    path = str(tmp_path / "c")
    out = run_ranks(2, _save_failing_on_rank_1, path)
    for msg in out:
        assert msg.startswith("CheckpointException"), msg
        assert "rank1_only" in msg and "without pickle" in msg
    assert not os.path.exists(os.path.join(path, INDEX_NAME))


def _save_twice(path: str) -> str:
    dcp.save({"w": torch.ones(8)}, storage_writer=ShardWriter(path))
    try:
        dcp.save({"w": torch.zeros(8)}, storage_writer=ShardWriter(path))
    except BaseException as e:
        return str(e)
    return "saved"


def test_saving_over_a_committed_checkpoint_is_refused_on_every_rank(tmp_path):
    out = run_ranks(2, _save_twice, str(tmp_path / "c"))
    for msg in out:
        assert CheckpointExistsError.__name__ in msg and "overwrite=True" in msg
    state = {"w": torch.empty(8)}
    dcp.load(state, storage_reader=ShardReader(str(tmp_path / "c")))
    assert torch.equal(state["w"], torch.ones(8))
