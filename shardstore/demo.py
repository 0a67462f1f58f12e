"""The demo job: train a small transformer with FSDP2 on N CPU ranks, save, resume on M ranks.

It shows the whole save/load path of shardstore on real FSDP2 state (model + AdamW + counters)
and that a resharded resume continues the run exactly.

Why the resumed loss can match bit for bit: every rank computes the same global batch and FSDP2
reduces gradients in float64, where the sum of identical float32 values divided by the world size
is exact. The training step is therefore independent of the world size, and any difference after
the resume could only come from the checkpoint. (Real jobs split the batch across ranks; their
losses after a world-size change then differ in the last bits from reduction order, not because
of the checkpoint.)
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


@dataclass(frozen=True)
class DemoConfig:
    """Options of ``shardstore demo`` (see ``shardstore demo --help``)."""

    ranks: int = 4
    resume_ranks: int = 2
    steps: int = 16
    save_every: int = 4
    crash_at: int = 14
    path: str = "./checkpoints"
    dim: int = 128
    layers: int = 2
    heads: int = 4
    vocab: int = 512
    seq: int = 32
    batch: int = 8
    lr: float = 3e-3
    seed: int = 0
    compression: str | None = None

    def __post_init__(self) -> None:
        if self.ranks < 1 or self.resume_ranks < 1:
            raise ValueError("--ranks and --resume-ranks must be at least 1")
        if not 1 <= self.save_every <= self.crash_at < self.steps:
            raise ValueError("need 1 <= --save-every <= --crash-at < --steps")


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    """A decoder-only transformer, small enough to train on CPU ranks."""

    def __init__(self, cfg: DemoConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Parameter(torch.zeros(cfg.seq, cfg.dim))
        self.blocks = nn.ModuleList(Block(cfg.dim, cfg.heads) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def batch_for_step(step: int, cfg: DemoConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: sequences x[i+1] = (5 x[i] + 3) mod vocab, random starts."""
    g = torch.Generator().manual_seed(cfg.seed * 100_003 + step)
    start = torch.randint(0, cfg.vocab, (cfg.batch, 1), generator=g)
    seq = [start]
    for _ in range(cfg.seq):
        seq.append((seq[-1] * 5 + 3) % cfg.vocab)
    tokens = torch.cat(seq, dim=1)
    return tokens[:, :-1], tokens[:, 1:]


def build(cfg: DemoConfig) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Model sharded with FSDP2 (float64 gradient reduction, see module docstring) + AdamW."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(cfg.seed)
    model = TinyTransformer(cfg)
    policy = MixedPrecisionPolicy(reduce_dtype=torch.float64)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model, torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)


def checkpoint_path(cfg: DemoConfig, step: int) -> str:
    return os.path.join(cfg.path, f"step-{step:012d}")


def _train(cfg: DemoConfig, phase: str, queue) -> None:
    """One rank's work: ``phase`` is "first" (train from scratch) or "resume"."""
    from shardstore import ShardReader, ShardWriter

    torch.set_num_threads(1)
    rank = dist.get_rank()
    model, opt = build(cfg)
    start = 0
    io: list[tuple[str, int, float, float]] = []
    if phase == "resume":
        step = max(s for s in range(cfg.save_every, cfg.crash_at + 1, cfg.save_every))
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd, "progress": {"step": 0}}
        t0 = time.perf_counter()
        reader = ShardReader(checkpoint_path(cfg, step))
        dcp.load(state, storage_reader=reader)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        io.append(("load", step, _allsum(reader.bytes_read), time.perf_counter() - t0))
        start = state["progress"]["step"]
    losses = []
    for step in range(start + 1, cfg.steps + 1):
        x, y = batch_for_step(step, cfg)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append((step, loss.item()))
        if phase == "first" and step % cfg.save_every == 0 and step <= cfg.crash_at:
            msd, osd = get_state_dict(model, opt)
            t0 = time.perf_counter()
            writer = ShardWriter(checkpoint_path(cfg, step), compression=cfg.compression, overwrite=True)
            dcp.save({"model": msd, "optim": osd, "progress": {"step": step}}, storage_writer=writer)
            io.append(("save", step, _allsum(writer.bytes_written), time.perf_counter() - t0))
    if rank == 0:
        queue.put({"losses": losses, "io": io})


def _allsum(n: int) -> float:
    t = torch.tensor([float(n)], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item()


def _rank_main(rank: int, world: int, port: int, cfg: DemoConfig, phase: str, queue) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(minutes=5)
    )
    try:
        _train(cfg, phase, queue)
    finally:
        dist.destroy_process_group()


def launch(world: int, cfg: DemoConfig, phase: str) -> dict:
    """Run one phase on ``world`` spawned gloo ranks; return rank 0's report."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_rank_main, args=(world, port, cfg, phase, queue), nprocs=world, join=True, start_method="spawn")
    return queue.get()


def run_demo(cfg: DemoConfig, out=print) -> bool:
    """The whole demo; prints a report and returns whether the resumed run matched exactly."""
    n_params = sum(p.numel() for p in TinyTransformer(cfg).parameters())
    out(f"shardstore demo: {n_params / 1e6:.2f} M-parameter transformer, FSDP2 + AdamW, checkpoints in {cfg.path}")
    out(f"phase 1: {cfg.ranks} ranks train steps 1..{cfg.steps}, saving every {cfg.save_every} steps "
        f"until a simulated crash after step {cfg.crash_at} (the rest of the run is the uninterrupted reference)")
    first = launch(cfg.ranks, cfg, "first")
    resume_step = max(s for s in range(cfg.save_every, cfg.crash_at + 1, cfg.save_every))
    out(f"phase 2: {cfg.resume_ranks} ranks resume from step {resume_step} and train to step {cfg.steps}")
    second = launch(cfg.resume_ranks, cfg, "resume")
    for kind, step, nbytes, seconds in first["io"] + second["io"]:
        ranks = cfg.ranks if kind == "save" else cfg.resume_ranks
        out(f"  {kind} step {step:>3} on {ranks} ranks: {nbytes / 1e6:7.1f} MB in {seconds:6.3f} s "
            f"= {nbytes / max(seconds, 1e-9) / 1e6:7.1f} MB/s")
    reference = dict(first["losses"])
    out(f"\n  step | loss, {cfg.ranks} ranks uninterrupted | loss, resumed on {cfg.resume_ranks} ranks")
    exact = True
    for step, loss in second["losses"]:
        same = loss == reference[step]
        exact &= same
        out(f"  {step:>4} | {reference[step]:.9f}{'':>17} | {loss:.9f} {'(same)' if same else '(DIFFERENT)'}")
    first_loss, last_loss = first["losses"][0][1], reference[cfg.steps]
    out(f"\nloss {first_loss:.3f} -> {last_loss:.3f} (chance level {math.log(cfg.vocab):.3f})")
    out("resumed run matches the uninterrupted run exactly" if exact else "MISMATCH: the resumed run diverged")
    return exact


def config_from_args(**kwargs) -> DemoConfig:
    fields = {f.name for f in dataclasses.fields(DemoConfig)}
    return DemoConfig(**{k: v for k, v in kwargs.items() if k in fields and v is not None})
