"""CheckpointManager: steps and retention, restore on other world sizes, crash safety, lease, gc."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import time

import msgpack
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from shardstore.testing import run_ranks
from states import Net, assert_same_state
from shardstore import StateMismatchError
from shardstore.backends import open_backend
from shardstore.config import INDEX_NAME
from shardstore.errors import CheckpointNotFoundError
from shardstore.index import FileEntry, decode_index, encode_index
from shardstore.lease import LeaseHeldError, LeaseLostError
from shardstore.manager import CheckpointManager, list_checkpoints, step_name
from shardstore.stateful import PerRank, TrainState

FAST = {"sync": False, "threads": 2}  # tests on scratch space: no fsync
THREADS = {"threads": 2}  # crash tests: durable saves, as in a real job


def _index(backend, step: int):
    return decode_index(backend.read_small(f"{step_name(step)}/{INDEX_NAME}"))


def _lr_lambda(epoch: int) -> float:
    return 0.5**epoch


def _build(seed: int, lr: float, *, fsdp: str | None = "fsdp2"):
    # FSDP1 needs an accelerator in torch 2.13; TrainState passes it to get_state_dict the same way.
    torch.manual_seed(seed)
    model: nn.Module = Net()
    model.emb.weight.requires_grad_(False)  # frozen: incremental saves reference it
    if fsdp == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda)
    return model, opt, sched


def _train(model, opt, sched, step: int) -> None:
    torch.manual_seed(step)
    model(torch.randint(0, 10, (4, 5))).backward()
    opt.step()
    sched.step()
    opt.zero_grad()


def _full(model, opt) -> dict:
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"model": msd, "optim": osd}


def _rng(rank: int, on_resize: str = "error") -> PerRank:
    return PerRank({"seed": 1000 + rank, "gen": torch.full((3,), float(rank))}, on_resize=on_resize)


# -- 2 ranks save 1..4 with keep_last=2; 3 ranks and one process restore step 4 ---------------


def _save_steps(root: str, fsdp: str) -> dict:
    model, opt, sched = _build(0, 0.01, fsdp=fsdp)
    state = TrainState(model, opt, sched, counters={"step": 0, "tag": "run-a"})
    with CheckpointManager(root, keep_last=2, incremental=True, lease_ttl=5, writer_options=FAST) as mgr:
        for step in range(1, 5):
            _train(model, opt, sched, step)
            state.counters["step"] = step
            mgr.save(step, {"train": state, "rng": _rng(dist.get_rank()), "extra": {"epoch": step // 2}})
        mgr.wait()  # retention runs on the coordinator after each commit
        dist.barrier()
        steps = mgr.steps()
    full = _full(model, opt)  # collective
    return {"steps": steps, "full": full if dist.get_rank() == 0 else {}, "sched": sched.state_dict()}


def _restore_step_4(root: str, fsdp: str) -> dict:
    model, opt, sched = _build(1, 0.5, fsdp=fsdp)  # other values everywhere: all must come from the checkpoint
    state = TrainState(model, opt, sched, counters={"step": -1})
    extra = {"epoch": -1}
    with CheckpointManager(root, reader_options={"threads": 2}) as mgr:
        try:  # per-rank state saved on 2 ranks cannot follow 3 ranks without a policy
            mgr.restore({"train": state, "rng": _rng(-1), "extra": extra})
            error = None
        except StateMismatchError as e:
            error = str(e)
        rng = _rng(-1, on_resize="rank0")
        step = mgr.restore({"train": state, "rng": rng, "extra": extra})
    full = _full(model, opt)  # collective
    return {
        "error": error,
        "step": step,
        "full": full if dist.get_rank() == 0 else {},
        "counters": state.counters,
        "sched": sched.state_dict(),
        "rng": rng.value,
        "extra": extra,
    }


@pytest.fixture(scope="module")
def saved_on_2(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("mgr") / "run")
    out = run_ranks(2, _save_steps, root, "fsdp2")
    return root, out


def test_two_ranks_keep_last_2_leaves_exactly_steps_3_and_4(saved_on_2):
    root, out = saved_on_2
    assert [o["steps"] for o in out] == [[3, 4], [3, 4]]
    backend = open_backend(root)
    indexes = {s: _index(backend, s) for s in (3, 4)}
    for step, index in indexes.items():
        assert index.world_size == 2 and index.user["step"] == step and index.user["per_rank"] == ["rng"]
    # incremental: the frozen embedding was written once, by step 1; steps 3 and 4 reference it
    assert {f.base for f in indexes[4].files} >= {step_name(1), None}
    referenced = {f"{f.base or step_name(s)}/{f.path}" for s, index in indexes.items() for f in index.files}
    on_storage = {p for p in backend.list() if not p.startswith("_lease/")}
    assert on_storage == referenced | {f"{step_name(s)}/{INDEX_NAME}" for s in (3, 4)}  # nothing else is left
    infos = {i.step: i for i in list_checkpoints(root)}
    assert sorted(infos) == [1, 3, 4] and not infos[1].committed  # step 1 only holds referenced data
    assert infos[1].referenced_by == (step_name(3), step_name(4)) and infos[4].referenced_by == (step_name(4),)
    assert infos[4].committed and infos[4].world_size == 2 and infos[4].bases[0] == step_name(1)
    assert infos[4].added_nbytes < infos[4].logical_nbytes
    beat = [f for f in os.listdir(os.path.join(root, "_lease")) if f.endswith(".beat")]
    assert msgpack.unpackb(open(os.path.join(root, "_lease", beat[-1]), "rb").read())["released"] is True


def test_three_ranks_restore_step_4_exactly_and_per_rank_state_needs_a_policy(saved_on_2):
    root, saved = saved_on_2
    out = run_ranks(3, _restore_step_4, root, "fsdp2")
    ref = saved[0]
    assert_same_state(ref["full"], out[0]["full"])
    assert ref["full"]["optim"]["state"]["l1.weight"]["step"].item() == 4.0
    for r in out:
        assert r["step"] == 4
        assert "'rng'" in r["error"] and "saved on 2 ranks" in r["error"] and "on 3 ranks" in r["error"]
        assert "on_resize='rank0'" in r["error"]
        assert r["counters"] == {"step": 4, "tag": "run-a"}
        assert r["extra"] == {"epoch": 2}
        assert r["sched"] == ref["sched"]
        assert_same_state(r["rng"], {"seed": 1000, "gen": torch.zeros(3)})


def test_single_process_without_process_group_restores_step_4(saved_on_2):
    root, saved = saved_on_2
    assert not dist.is_initialized()
    model, opt, sched = _build(3, 0.5, fsdp=None)
    state = TrainState(model, opt, sched, counters={})
    rng = _rng(-1, on_resize="drop")
    before = rng.value
    with CheckpointManager(root) as mgr:
        assert mgr.steps() == [3, 4] and mgr.latest_step() == 4
        assert mgr.restore({"train": state, "rng": rng, "extra": {"epoch": 0}}) == 4
        assert mgr.restore({"train": state, "rng": rng, "extra": {"epoch": 0}}, step=3) == 3
        assert state.counters["step"] == 3
        assert mgr.restore({"train": state, "rng": rng, "extra": {"epoch": 0}}, step=4) == 4
        with pytest.raises(CheckpointNotFoundError, match=r"step 2 is not a committed checkpoint.*3, 4"):
            mgr.restore({"train": state}, step=2)
    assert rng.value is before  # dropped: the live value stays
    assert_same_state(saved[0]["full"], _full(model, opt))
    assert state.counters == {"step": 4, "tag": "run-a"}
    assert sched.state_dict() == saved[0]["sched"]


# -- single process: retention, failures, leftovers, gc ----------------------------------------


def _tensors(step: int) -> dict:
    return {"w": torch.full((64, 64), float(step)), "b": torch.arange(10) + step, "meta": {"step": step}}


def _check_step(mgr: CheckpointManager, step: int) -> None:
    target = {"w": torch.zeros(64, 64), "b": torch.zeros(10, dtype=torch.int64), "meta": {"step": -1}}
    assert mgr.restore(target, step=step) == step
    assert_same_state(_tensors(step), target)


def test_keep_every_keeps_multiples_forever(tmp_path):
    with CheckpointManager(tmp_path, keep_last=2, keep_every=3, writer_options=FAST) as mgr:
        for step in range(1, 9):
            mgr.save(step, _tensors(step))
        mgr.wait()
        assert mgr.steps() == [3, 6, 7, 8]
        assert mgr.gc(dry_run=True) == []
        for step in mgr.steps():
            _check_step(mgr, step)


class _Unstorable:
    pass


def test_a_failing_save_deletes_nothing_and_the_next_save_works(tmp_path):
    with CheckpointManager(tmp_path, keep_last=1, writer_options=FAST) as mgr:
        mgr.save(1, _tensors(1))
        with pytest.raises(CheckpointException, match="without pickle"):
            mgr.save(2, {**_tensors(2), "bad": _Unstorable()})
        mgr.wait()
        assert mgr.steps() == [1]
        _check_step(mgr, 1)
        mgr.save(2, _tensors(2))
        mgr.wait()
        assert mgr.steps() == [2]
        _check_step(mgr, 2)
        with pytest.raises(CheckpointException, match="already holds a committed checkpoint"):
            mgr.save(2, _tensors(3))
        mgr.wait()
        assert mgr.steps() == [2]
        _check_step(mgr, 2)


def test_leftovers_of_crashed_saves_are_removed_but_not_a_save_in_progress(tmp_path):
    root = str(tmp_path)
    with CheckpointManager(root, writer_options=FAST) as mgr:
        mgr.save(1, _tensors(1))
    backend = open_backend(root)
    junk = [f"{step_name(0)}/data-dead-r00000-00.bin", f"{step_name(1)}/data-dead-r00000-00.bin",
            f"{step_name(7)}/data-dead-r00001-00.bin", f"{step_name(7)}/{INDEX_NAME}.tmp-1234"]
    for path in junk:
        with backend.open_writer(path) as f:
            f.write(b"x" * 100)
    with CheckpointManager(root, writer_options=FAST) as mgr:
        assert mgr.steps() == [1]
        # without the lease, step 7 (newer than every committed step) may be a save in progress
        assert mgr.gc(dry_run=True) == junk[:2]
        assert mgr.gc() == junk  # with the lease no other job can be saving
        assert mgr.gc() == []
        mgr.save(2, _tensors(2))
        mgr.wait()
        assert mgr.steps() == [1, 2]
    assert sorted(backend.list()) == sorted(
        [p for p in backend.list() if p.startswith("_lease/")]
        + [f"{step_name(s)}/{f.path}" for s in (1, 2) for f in _index(backend, s).files]
        + [f"{step_name(s)}/{INDEX_NAME}" for s in (1, 2)]
    )


def test_gc_keeps_data_that_a_kept_step_references(tmp_path):
    """Step 2's index references step 1's data file (as an incremental save records it)."""
    root = str(tmp_path)
    backend = open_backend(root)
    with CheckpointManager(root, keep_last=1, writer_options=FAST) as mgr:
        mgr.save(1, _tensors(1))
        mgr.wait()
        index = _index(backend, 1)
        index.files = [FileEntry(path=f.path, size=f.size, base=step_name(1)) for f in index.files]
        index.user = {"step": 2, "per_rank": []}
        backend.publish(f"{step_name(2)}/{INDEX_NAME}", encode_index(index), overwrite=False)
        shared = [f"{step_name(1)}/{f.path}" for f in index.files]
        deleted = mgr.gc()
        assert deleted == [f"{step_name(1)}/{INDEX_NAME}"]
        assert mgr.steps() == [2]
        assert all(backend.exists(p) for p in shared)
        info = {i.step: i for i in list_checkpoints(root)}
        assert not info[1].committed and info[2].committed
        assert info[2].bases == (step_name(1),) and info[2].added_nbytes == 0
        mgr.save(3, _tensors(3))
        mgr.wait()
        assert mgr.steps() == [3]
    assert not any(backend.exists(p) for p in shared)
    assert sorted({p.split("/")[0] for p in backend.list()}) == ["_lease", step_name(3)]


@pytest.mark.parametrize("incremental", [False, True])
def test_async_saves_with_retention(tmp_path, incremental):
    with CheckpointManager(tmp_path, keep_last=2, async_save=True, incremental=incremental, writer_options=FAST) as mgr:
        for step in range(1, 6):
            state = _tensors(step)
            mgr.save(step, state)
            state["w"].fill_(-1.0)  # staged already: changing it now must not reach the checkpoint
        mgr.wait()
        assert mgr.steps() == [4, 5]
        _check_step(mgr, 4)
        _check_step(mgr, 5)
        mgr.save(6, {**_tensors(6), "bad": _Unstorable()})
        with pytest.raises(CheckpointException, match="without pickle"):
            mgr.wait()
        mgr.wait()  # raised once
        assert mgr.steps() == [4, 5]
        mgr.save(6, _tensors(6))
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.steps() == [5, 6]
        _check_step(mgr, 5)
        _check_step(mgr, 6)


def _lora(step: int) -> dict:
    torch.manual_seed(0)
    return {"frozen": torch.randn(512, 512), "adapter": torch.full((16, 512), float(step)), "meta": {"step": step}}


def test_incremental_keep_last_1_keeps_only_what_the_latest_step_references(tmp_path):
    root = str(tmp_path)
    backend = open_backend(root)
    with CheckpointManager(root, keep_last=1, incremental=True, writer_options=FAST) as mgr:
        for step in range(1, 5):
            mgr.save(step, _lora(step))
            mgr.wait()
            assert mgr.steps() == [step]
            info = {i.step: i for i in list_checkpoints(root)}[step]
            if step > 1:  # only the adapter was written again
                assert info.added_nbytes < 0.1 * info.logical_nbytes, info
                assert info.bases == (step_name(1),)
    index = _index(backend, 4)
    referenced = {f"{f.base or step_name(4)}/{f.path}" for f in index.files}
    assert any(p.startswith(step_name(1)) for p in referenced)
    assert {p for p in backend.list() if not p.startswith("_lease/")} == referenced | {f"{step_name(4)}/{INDEX_NAME}"}
    with CheckpointManager(root) as fresh:
        target = {"frozen": torch.zeros(512, 512), "adapter": torch.zeros(16, 512), "meta": {"step": -1}}
        assert fresh.restore(target) == 4
        assert_same_state(_lora(4), target)


# -- lease: two jobs on one root -------------------------------------------------------------------


@pytest.mark.parametrize("store", ["local", "s3"])
def test_a_second_job_on_the_same_root_is_refused(store, tmp_path, request):
    if store == "s3":
        loc = request.getfixturevalue("s3_url")
        root, opts = loc.url, loc.storage_options
    else:
        root, opts = str(tmp_path), None
    first = CheckpointManager(root, lease_ttl=2, storage_options=opts, writer_options=FAST)
    try:
        first.save(1, _tensors(1))
        with CheckpointManager(root, lease_ttl=2, storage_options=opts, writer_options=FAST) as second:
            t0 = time.monotonic()
            with pytest.raises(LeaseHeldError, match="in use by another job.*pid"):
                second.save(2, _tensors(2))
            assert time.monotonic() - t0 < 2  # a live heartbeat changes within ttl / 4
            with pytest.raises(LeaseHeldError):
                second.gc()
            assert second.steps() == [1]  # reading needs no lease
            _check_step(second, 1)
    finally:
        first.close()  # releases: the next job takes over at once
    with CheckpointManager(root, lease_ttl=30, storage_options=opts, writer_options=FAST) as third:
        t0 = time.monotonic()
        third.save(2, _tensors(2))
        assert time.monotonic() - t0 < 10
        assert third.steps() == [1, 2]


def test_a_job_that_stalled_past_the_ttl_loses_the_lease_and_does_not_commit(tmp_path):
    root = str(tmp_path)
    with CheckpointManager(root, lease_ttl=0.5, writer_options=FAST) as stalled:
        stalled.save(1, _tensors(1))
        stalled._lease._stop.set()  # the job hangs: its heartbeat stops
        with CheckpointManager(root, lease_ttl=0.5, writer_options=FAST) as other:
            other.save(2, _tensors(2))  # watches the heartbeat stand still for ttl, takes over
            with pytest.raises(CheckpointException, match=r"lost the lease.*pid"):
                stalled.save(3, _tensors(3))
            with pytest.raises(LeaseLostError):
                stalled.gc()
            other.save(4, _tensors(4))
            other.wait()
            assert other.steps() == [1, 2, 4]
            leftovers = [p for p in open_backend(root).list() if p.startswith(step_name(3))]
            assert leftovers and other.gc() == leftovers  # a full gc finds what the stalled job wrote


# -- crash safety: SIGKILL at random moments ---------------------------------------------------------


def _crash_state(step: int, rows: int = 256) -> dict:
    return {f"t{i}": torch.full((rows, 1024), float(step * 10 + i)) for i in range(4)} | {"meta": {"step": step}}


def _crash_target(rows: int) -> dict:
    return {f"t{i}": torch.empty(rows, 1024) for i in range(4)} | {"meta": {"step": -1}}


def _crash_loop(root: str, opts: dict | None, log: str, rows: int, ttl: float) -> None:
    """Save steps until killed; append 'committed N' to ``log`` after each save returns."""
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.write(fd, b"started\n")
    mgr = CheckpointManager(root, keep_last=2, lease_ttl=ttl, storage_options=opts, writer_options=THREADS)
    step = mgr.latest_step() or 0
    while True:
        step += 1
        mgr.save(step, _crash_state(step, rows))
        os.write(fd, f"committed {step}\n".encode())


def _check_crashed_store(root: str, opts: dict | None, known: set[int], rows: int) -> list[int]:
    """Assert the store after a kill: only committed steps listed, each restores exactly."""
    with CheckpointManager(root, storage_options=opts) as mgr:
        steps = mgr.steps()
        if not known:
            assert steps in ([], [1]), steps
            return steps
        last = max(known)
        assert set(steps) <= known | {last + 1}, (steps, sorted(known))
        assert last in steps, (steps, sorted(known))
        for step in steps:  # every listed step is complete and exact
            target = _crash_target(rows)
            assert mgr.restore(target, step=step) == step
            assert_same_state(_crash_state(step, rows), target)
        target = {"meta": {"step": -1}}
        assert mgr.restore(target) == steps[-1] and target["meta"]["step"] == steps[-1]
        return steps


def _wait_for_line(log: str, word: str, proc, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not (os.path.exists(log) and word in open(log).read()):
        assert time.monotonic() < deadline and proc.is_alive(), f"the save loop never logged {word!r}"
        time.sleep(0.005)


def _crash_trials(root: str, opts: dict | None, tmp_path, *, trials: int, seed: int, rows: int, ttl: float,
                  window: float) -> None:
    """Kill a save loop with SIGKILL ``trials`` times; after each, check the store; then save on.

    Trial 0 is killed at a random moment after the process starts (lease, first save); later
    trials at a random moment within ``window`` seconds after their first commit (mid-save,
    mid-retention, between saves).
    """
    ctx = mp.get_context("forkserver")  # torch is imported once, in the fork server
    ctx.set_forkserver_preload(["torch", "s3fs", "shardstore.manager", "test_manager"])
    rng = random.Random(seed)
    known: set[int] = set()
    for trial in range(trials):
        log = str(tmp_path / f"log-{trial}")
        proc = ctx.Process(target=_crash_loop, args=(root, opts, log, rows, ttl), daemon=True)
        proc.start()
        _wait_for_line(log, "started" if trial == 0 else "committed", proc)
        time.sleep(rng.uniform(0, window))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        assert proc.exitcode == -signal.SIGKILL, f"the save loop ended on its own: {proc.exitcode}"
        known |= {int(line.split()[1]) for line in open(log).read().splitlines() if line.startswith("committed")}
        known |= set(_check_crashed_store(root, opts, known, rows))
    with CheckpointManager(root, keep_last=2, lease_ttl=ttl, storage_options=opts, writer_options=THREADS) as mgr:
        nxt = (mgr.latest_step() or 0) + 1
        mgr.save(nxt, _crash_state(nxt, rows))
        mgr.wait()
        steps = mgr.steps()
        assert steps[-1] == nxt and len(steps) <= 2
        target = _crash_target(rows)
        assert mgr.restore(target) == nxt
        assert_same_state(_crash_state(nxt, rows), target)
    backend = open_backend(root, opts)
    assert {p.split("/")[0] for p in backend.list()} == {"_lease"} | {step_name(s) for s in steps}


def test_sigkill_at_random_moments_local(tmp_path):
    _crash_trials(str(tmp_path / "run"), None, tmp_path, trials=6, seed=3, rows=256, ttl=0.4, window=0.5)


def test_sigkill_at_random_moments_s3(s3_url, tmp_path):
    _crash_trials(s3_url.url, s3_url.storage_options, tmp_path, trials=3, seed=4, rows=16, ttl=1.0, window=1.0)
