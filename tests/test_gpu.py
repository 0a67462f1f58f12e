"""GPU paths: pinned staging with side-stream copies, loads into CUDA tensors, FSDP1 on a GPU.

CI and this project's development machines have no GPU, so these tests are skipped there; they
run on any machine with CUDA (``python -m pytest tests/test_gpu.py``) in one process with a
world-size-1 process group (NCCL for CUDA tensors, gloo for CPU ones). What they pin down:

* staging copies GPU state into *pinned* host memory on a side stream that waits for the
  compute stream, so a value still being computed when ``stage`` is called is staged whole;
* an async save of CUDA state returns before the write and is not affected by training that
  goes on, through both ``shardstore.async_save`` and ``dcp.async_save(storage_writer=...)``,
  with the whole-state arena and with the bounded slice pool;
* ``ShardReader`` loads into CUDA targets, with and without a dtype cast;
* FSDP1 (which needs an accelerator in current PyTorch) round-trips through ``TrainState`` +
  ``CheckpointManager`` and restores into an FSDP2 model. On one GPU FSDP1 runs unsharded
  (``NO_SHARD``), so its state holds plain tensors; the ShardedTensor layout of a sharded FSDP1
  state is covered on CPU by ``tests/test_core_dist.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from states import assert_same_state
from shardstore import CheckpointManager, ShardReader, ShardWriter, TrainState
from shardstore.async_save import AsyncSaver, async_save
from shardstore.staging import StagingBuffers

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    """A world-size-1 process group: NCCL for CUDA tensors, gloo for CPU ones."""
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"file://{store}", rank=0, world_size=1)
    torch.cuda.set_device(0)
    yield dist.group.WORLD
    dist.destroy_process_group()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(256, 512)
        self.l2 = nn.Linear(512, 256, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.relu(self.l1(x))).square().mean()


def _step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(seed)
    model(torch.randn(32, 256, device="cuda", generator=g)).backward()
    opt.step()
    opt.zero_grad()


def _full(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return copy.deepcopy({"model": msd, "optim": osd})


# -- staging ------------------------------------------------------------------------------------


def test_staging_waits_for_the_compute_stream_and_pins_a_reused_arena():
    torch.manual_seed(0)
    x = torch.randn(4096, 4096, device="cuda")
    buffers = StagingBuffers()
    for round_ in range(3):
        y = x @ x + round_  # queued on the compute stream; stage() is called before it finishes
        staged = buffers.stage({"y": y, "step": round_})
        expected = y.cpu()
        assert staged["y"].device.type == "cpu" and staged["y"].is_pinned()
        assert torch.equal(staged["y"], expected), f"round {round_}: staged copy is not the finished value"
        y.add_(1.0)  # training goes on: the staged copy must not follow
        torch.cuda.synchronize()
        assert torch.equal(staged["y"], expected)
        assert staged["step"] == round_
        del staged
    assert buffers.pinned
    assert buffers.allocations == 1, "the pinned arena must be reused across saves of the same structure"


# -- async saves of CUDA state, loads into CUDA targets -----------------------------------------


@pytest.mark.parametrize("how", ["shardstore", "dcp", "bounded"])
def test_async_save_of_cuda_state_is_a_snapshot_and_loads_into_cuda(group, tmp_path, how):
    torch.manual_seed(0)
    model = Net().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _step(model, opt, 1)
    ref = _full(model, opt)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "extra": {"step": 1}}
    path = str(tmp_path / how)
    writer = ShardWriter(path, sync=False)
    if how == "shardstore":
        handle = async_save(state, storage_writer=writer)
    elif how == "bounded":  # the slice pool (pinned): 256 KiB, less than the state, more than any item
        handle = AsyncSaver(max_staging_bytes=1 << 19, slot=None).save(state, storage_writer=writer)
    else:
        handle = dcp.async_save(state, storage_writer=writer)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1000.0)
    _step(model, opt, 2)
    if how == "dcp":
        handle.result()
    else:
        assert handle.wait() is not None

    torch.manual_seed(7)
    fresh = Net().cuda()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    _step(fresh, fresh_opt, 3)  # optimizer state exists, with other values
    msd, osd = get_state_dict(fresh, fresh_opt)
    target = {"model": msd, "optim": osd, "extra": {"step": 0}}
    dcp.load(target, storage_reader=ShardReader(path))
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(fresh, fresh_opt, model_state_dict=target["model"], optim_state_dict=target["optim"])
    assert next(fresh.parameters()).device.type == "cuda"
    assert_same_state(ref, _full(fresh, fresh_opt))
    assert target["extra"] == {"step": 1}


def test_bf16_checkpoint_loads_into_fp32_cuda_tensors(group, tmp_path):
    torch.manual_seed(0)
    src = {"w": torch.randn(1000, 333, device="cuda").bfloat16(), "b": torch.randn(7, device="cuda").bfloat16()}
    dcp.save(src, storage_writer=ShardWriter(tmp_path / "c", sync=False, frame_size=4096))
    dst = {"w": torch.zeros(1000, 333, device="cuda"), "b": torch.zeros(7, device="cuda")}
    dcp.load(dst, storage_reader=ShardReader(tmp_path / "c"))
    for k in src:
        assert dst[k].dtype == torch.float32 and dst[k].device.type == "cuda"
        assert torch.equal(dst[k], src[k].float()), k


# -- FSDP1 --------------------------------------------------------------------------------------


def test_fsdp1_sharded_state_round_trips_through_trainstate_and_loads_into_fsdp2(group, tmp_path):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = FSDP(Net().cuda(), use_orig_params=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _step(model, opt, 1)
    _step(model, opt, 2)
    ref = _full(model, opt)
    state = TrainState(model, opt, counters={"step": 2, "epoch": 0})
    mgr = CheckpointManager(tmp_path / "ckpt", lease_ttl=None)
    mgr.save(2, {"train": state})
    mgr.close()

    torch.manual_seed(5)
    fresh = FSDP(Net().cuda(), use_orig_params=True)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    fresh_state = TrainState(fresh, fresh_opt, counters={"step": 0})
    mgr = CheckpointManager(tmp_path / "ckpt", lease_ttl=None)
    assert mgr.restore({"train": fresh_state}) == 2
    mgr.close()
    assert_same_state(ref, _full(fresh, fresh_opt))
    assert fresh_state.counters == {"step": 2, "epoch": 0}

    torch.manual_seed(6)
    net2 = Net().cuda()
    fully_shard(net2)
    opt2 = torch.optim.AdamW(net2.parameters(), lr=1e-3)
    state2 = TrainState(net2, opt2)
    mgr = CheckpointManager(tmp_path / "ckpt", lease_ttl=None)
    assert mgr.restore({"train": state2}) == 2
    mgr.close()
    assert_same_state(ref, _full(net2, opt2))
