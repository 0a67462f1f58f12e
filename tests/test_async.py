"""Async saves: snapshot semantics, resharded loads, background failures, busy saves, flat memory."""

from __future__ import annotations

import copy
import os
import time

import psutil
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from shardstore.testing import run_ranks
from states import Net, assert_same_state
from shardstore import ShardReader, ShardWriter
from shardstore.async_save import AsyncSaveInProgressError, AsyncSaver, async_save, prepare
from shardstore.config import INDEX_NAME
from shardstore.errors import StorageError
from shardstore.staging import default_slot


def _fsdp2(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = Net()
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randint(0, 10, (4, 5))).backward()
    opt.step()
    opt.zero_grad()


def _full(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return copy.deepcopy({"model": msd, "optim": osd})  # scalar "step" tensors alias the live ones


def _default_group_allreduces(n: int) -> None:
    """Training-style collectives on the default group while a save runs in the background."""
    for i in range(n):
        t = torch.full((64,), float(i + dist.get_rank()))
        dist.all_reduce(t)
        assert torch.equal(t, torch.full((64,), float(2 * i + 1))), "default-group collective garbled"


# -- snapshot semantics + resharded load ----------------------------------------------------------


def _async_save_fsdp2_then_train(path: str, bounded: bool) -> dict:
    model, opt = _fsdp2(seed=0)
    torch.manual_seed(1)
    _step(model, opt)
    ref = _full(model, opt)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "extra": {"step": 1, "lrs": [0.01]}}
    writer = ShardWriter(path, sync=False, threads=1)
    if bounded:  # pool of 1 KiB: smaller than the state (~6 KiB per rank), larger than any item
        handle = AsyncSaver(max_staging_bytes=1024, slot=None).save(state, storage_writer=writer)
    else:
        handle = async_save(state, storage_writer=writer)
    for p in model.parameters():  # right after the call: nothing of this may reach the checkpoint
        p.data.add_(1000.0)
    _step(model, opt)
    state["extra"]["step"] = 99
    state["extra"]["lrs"].append(5.0)
    _default_group_allreduces(20)
    assert handle.wait() is not None
    assert handle.done()
    return ref if dist.get_rank() == 0 else {}


def _load_fsdp2(path: str) -> dict:
    model, opt = _fsdp2(seed=5)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "extra": {"step": 0, "lrs": []}}
    dcp.load(state, storage_reader=ShardReader(path))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    full = _full(model, opt)
    return {"full": full if dist.get_rank() == 0 else {}, "extra": state["extra"]}


def test_values_changed_after_the_call_do_not_reach_the_checkpoint_which_loads_on_1_rank(tmp_path):
    for bounded in (False, True):
        path = str(tmp_path / f"c-{bounded}")
        ref = run_ranks(2, _async_save_fsdp2_then_train, path, bounded)[0]
        out = run_ranks(1, _load_fsdp2, path)  # 2 -> 1 ranks (more ranks: see test_core_dist)
        assert_same_state(ref, out[0]["full"], f"bounded={bounded}")
        assert all(r["extra"] == {"step": 1, "lrs": [0.01]} for r in out)


def _dcp_async_save_dtensors(path: str) -> list[int]:
    from torch.distributed._shard.sharded_tensor import Shard as STShard
    from torch.distributed._shard.sharded_tensor import init_from_local_shards
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    full = torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8)
    w = distribute_tensor(full.clone(), mesh, [Shard(0)])
    st = init_from_local_shards([STShard.from_tensor_and_offsets(full[rank * 32 : rank * 32 + 32].clone(), [rank * 32, 0], rank)], [64, 8])
    group = dist.new_group(backend="gloo")  # isolates DCP's background collectives (as documented)
    ptrs = []
    for i in range(2):
        state = {"w": w, "st": st, "n": i}
        fut = dcp.async_save(state, storage_writer=ShardWriter(f"{path}-{i}", sync=False), process_group=group)
        w.to_local().add_(1000.0)
        st.local_shards()[0].tensor.add_(1000.0)
        fut.result()
        w.to_local().sub_(1000.0)
        st.local_shards()[0].tensor.sub_(1000.0)
        ptrs.append(default_slot().buffers._buffers[0].data_ptr())
    assert default_slot().buffers.allocations >= 1
    return ptrs


def _load_rows(path: str) -> bool:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    state = {"w": distribute_tensor(torch.zeros(64, 8), mesh, [Shard(0)]),
             "st": distribute_tensor(torch.zeros(64, 8), mesh, [Shard(1)]), "n": -1}
    dcp.load(state, storage_reader=ShardReader(path))
    full = torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8)
    assert torch.equal(state["w"].full_tensor(), full)
    assert torch.equal(state["st"].full_tensor(), full)
    return state["n"]


def test_dcp_async_save_with_shardwriter_stages_a_snapshot_into_reused_buffers(tmp_path):
    path = str(tmp_path / "c")
    ptrs = run_ranks(2, _dcp_async_save_dtensors, path)
    assert all(p[0] == p[1] for p in ptrs), "second dcp.async_save re-allocated its staging buffers"
    assert run_ranks(1, _load_rows, f"{path}-0") == [0]
    assert run_ranks(1, _load_rows, f"{path}-1") == [1]


# -- failures -------------------------------------------------------------------------------------


class FailingWriter(ShardWriter):
    """A ShardWriter whose storage fails on one rank while writing data."""

    def __init__(self, path: str, fail_rank: int, **options) -> None:
        super().__init__(path, **options)
        self.fail_rank = fail_rank

    def write_data(self, plan, planner):
        if dist.get_rank() == self.fail_rank:
            raise StorageError(f"injected: disk full writing {self.path}")
        return super().write_data(plan, planner)


def _failures(root: str) -> dict:
    rank = dist.get_rank()
    state = {"w": torch.full((1000,), float(rank)), "step": 3}
    out = {}
    # 1. the failure surfaces on wait(), once
    handle = async_save(state, storage_writer=FailingWriter(f"{root}/a", fail_rank=1, sync=False))
    try:
        handle.wait()
        out["wait"] = "no error"
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        out["wait"] = f"{type(e).__name__}: {e}"
    out["second_wait"] = repr(handle.wait())
    out["after_wait"] = repr(async_save(state, storage_writer=ShardWriter(f"{root}/b", sync=False)).wait() is not None)
    # 2. not waited for: the next save raises it (and does not start); the one after works
    async_save(state, storage_writer=FailingWriter(f"{root}/c", fail_rank=0, sync=False))
    try:
        async_save(state, storage_writer=ShardWriter(f"{root}/never", sync=False))
        out["next_save"] = "no error"
    except BaseException as e:
        out["next_save"] = f"{type(e).__name__}: {e}"
    out["then"] = repr(async_save(state, storage_writer=ShardWriter(f"{root}/d", sync=False)).wait() is not None)
    # 3. staging fails on rank 1 only: it raises at once, rank 0 fails on wait() instead of hanging
    bad = dict(state, sp=torch.eye(3).to_sparse()) if rank == 1 else state
    try:
        handle = async_save(bad, storage_writer=ShardWriter(f"{root}/e", sync=False))
        handle.wait()
        out["staging"] = "no error"
    except BaseException as e:
        out["staging"] = f"{type(e).__name__}: {e}"
    out["after_staging"] = repr(async_save(state, storage_writer=ShardWriter(f"{root}/f", sync=False)).wait() is not None)
    return out


def test_background_failures_surface_once_on_every_rank_and_publish_nothing(tmp_path):
    root = str(tmp_path)
    out = run_ranks(2, _failures, root)
    for rank, r in enumerate(out):
        assert r["wait"].startswith("CheckpointException") and "injected: disk full" in r["wait"], r
        assert r["second_wait"] == "None"
        assert r["after_wait"] == "True"
        assert r["next_save"].startswith("CheckpointException") and f"{root}/c" in r["next_save"], r
        assert r["then"] == "True"
        assert r["after_staging"] == "True"
    assert "UnsupportedValueError" in out[1]["staging"] and "'sp'" in out[1]["staging"]
    assert out[0]["staging"].startswith("CheckpointException") and "could not stage" in out[0]["staging"]
    for name in "ace":
        assert not os.path.exists(os.path.join(root, name, INDEX_NAME)), name
    assert not os.path.exists(os.path.join(root, "never"))
    for name in "bdf":
        assert os.path.exists(os.path.join(root, name, INDEX_NAME)), name


class SlowWriter(ShardWriter):
    """A ShardWriter that takes a while to write on rank 0 only."""

    def write_data(self, plan, planner):
        if dist.get_rank() == 0:
            time.sleep(1.5)
        return super().write_data(plan, planner)


def _busy(root: str) -> list[str]:
    saver = AsyncSaver(if_busy="raise")
    state = {"w": torch.ones(100)}
    first = saver.save(state, storage_writer=SlowWriter(f"{root}/a", sync=False))
    if dist.get_rank() == 1:
        first.wait()  # rank 1 asks once the first save is over; rank 0 asks while it still runs
    else:
        time.sleep(0.2)
    events = [f"done={first.done()}"]
    try:
        saver.save(state, storage_writer=ShardWriter(f"{root}/b", sync=False))
        events.append("second started")
    except AsyncSaveInProgressError as e:
        events.append(f"refused: {e}")
    first.wait()
    saver.save(state, storage_writer=ShardWriter(f"{root}/c", sync=False)).wait()
    saver.close()
    return events


def test_if_busy_raise_refuses_on_every_rank_together(tmp_path):
    out = run_ranks(2, _busy, str(tmp_path))
    assert out[0][0] == "done=False" and out[1][0] == "done=True"
    for events in out:
        assert events[1].startswith("refused") and f"{tmp_path}/a" in events[1], events
    assert os.path.exists(tmp_path / "a" / INDEX_NAME) and os.path.exists(tmp_path / "c" / INDEX_NAME)
    assert not os.path.exists(tmp_path / "b")


# -- memory ---------------------------------------------------------------------------------------


def _ten_saves(root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    # 32 MiB per rank in 8 DTensors
    state = {f"w{i}": distribute_tensor(torch.randn(2048, 1024), mesh, [Shard(0)]) for i in range(8)}
    proc = psutil.Process()
    assert prepare(state) == sum(v.to_local().nbytes for v in state.values())
    rss, ptrs = [], {default_slot().buffers._buffers[0].data_ptr()}
    for i in range(10):
        state["step"] = i
        async_save(state, storage_writer=ShardWriter(f"{root}/s{i}", sync=False)).wait()
        rss.append(proc.memory_info().rss)
        ptrs.add(default_slot().buffers._buffers[0].data_ptr())
    state_bytes = sum(v.to_local().nbytes for k, v in state.items() if k != "step")
    return {"rss": rss, "ptrs": len(ptrs), "state": state_bytes, "arena": default_slot().buffers.nbytes}


def test_ten_async_saves_keep_host_memory_flat(tmp_path):
    for r in run_ranks(2, _ten_saves, str(tmp_path)):
        assert r["ptrs"] == 1, "staging buffers were re-allocated after prepare()"
        assert r["state"] <= r["arena"] <= r["state"] + 64 * 9
        growth = max(r["rss"][1:]) - r["rss"][0]
        assert growth < r["state"] // 4, f"RSS grew by {growth / 2**20:.1f} MiB after the first save: {r['rss']}"
