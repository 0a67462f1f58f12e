"""Example trainer that every recipe under ``deploy/`` runs: FSDP2, async saves, resume anywhere.

This is the training job of the deploy stage: it shows how a real job uses
:class:`shardstore.CheckpointManager` and is what the Kubernetes, Slurm and docker compose
recipes launch under ``torchrun`` (one agent per node, c10d rendezvous). It is written so that
a job killed at any moment and restarted on any number of nodes and GPUs continues exactly:

* **Data is a pure function of (seed, step).** The global batch of step ``s`` is the same on
  every world size and each rank takes its contiguous slice of it, so the only data-loader
  state is the step, which the checkpoint holds. The model (``shardstore.demo``'s small
  transformer) has no dropout and the data has its own generator, so no per-rank state (RNG
  streams) lives outside the checkpoint, which is why a restore under another world size
  needs no :class:`~shardstore.stateful.PerRank` policy.
* **The global batch is fixed**; the per-rank batch is ``global_batch / world_size``. A resumed
  run on another number of GPUs therefore computes the same updates (up to floating-point
  summation order).
* **Every rank builds the full model from the same seed** before ``fully_shard`` keeps its
  shard, so a fresh start is the same on any world size, too.
* **Saves are asynchronous** (``CheckpointManager(async_save=True)``): ``save`` returns once
  the state is staged in host memory and training continues while it is written. The manager
  commits a step only when every rank's data is stored (index last), so a crash at any instant
  leaves the previous committed step to resume from.
* **SIGTERM saves before exiting.** Schedulers send it before they kill a job (Kubernetes pod
  deletion, Slurm preemption/time limit, torchrun forwarding it to its workers). The handler
  only sets a flag; at the next step boundary the ranks agree (an all-reduce) and save the
  current step synchronously, then exit.

Configuration: every flag ``--some-option`` can also be set as the environment variable
``TRAIN_SOME_OPTION`` (a flag wins over the variable), so containers and batch scripts can
configure the trainer without editing a command line. ``TRAIN_CKPT_ROOT`` (a path, ``file://``
or ``s3://`` URL) is the only required setting. S3 credentials and the endpoint of MinIO or
another S3-compatible store come from botocore's usual variables (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL_S3``...) or profile chain; ``--s3-endpoint``
overrides the endpoint for this trainer only.

Run it (one node, two CPU processes)::

    torchrun --standalone --nproc-per-node 2 examples/train.py --ckpt-root /tmp/run1 --steps 50

See ``docs/deploy.md`` for the multi-node recipes.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import os
import signal
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.fsdp import fully_shard

from shardstore.demo import DemoConfig, TinyTransformer, batch_for_step
from shardstore.errors import StateMismatchError
from shardstore.manager import CheckpointManager
from shardstore.stateful import TrainState

logger = logging.getLogger("shardstore.examples.train")

ENV_PREFIX = "TRAIN_"


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything the trainer can be told; each field is a flag and a ``TRAIN_*`` variable.

    Attributes:
        ckpt_root: checkpoint root (local/NFS path, ``file://`` or ``s3://`` URL).
        s3_endpoint: endpoint URL of an S3-compatible store (MinIO, Ceph), for this trainer
            only; empty: botocore's own settings (``AWS_ENDPOINT_URL_S3``, or AWS itself).
        steps: train until this step (a restarted job that is already there exits at once).
        save_every: save every this many steps (and always at the last step).
        keep_last: committed checkpoints to keep (older ones are deleted after a newer commit).
        compression: ``none`` or ``zstd``.
        global_batch: sequences per step across all ranks; must be divisible by the world size.
        lr: AdamW learning rate.
        seed: seed of the model initialisation and of the synthetic data.
        dim, layers, heads, vocab, seq_len: shape of the transformer (``shardstore.demo``)
            and of its synthetic sequences.
        dist_backend: ``auto`` (nccl with GPUs, else gloo), ``nccl`` or ``gloo``.
        log_every: log the loss every this many steps (rank 0).
        metrics_file: if set, rank 0 appends one JSON line per event (resume, step, save).
        digest: add a SHA-256 of the full state (model and optimizer, gathered) to the
            ``resume`` and ``save`` metric lines, to check bit-exact restores. Costs a
            gather of the whole state; for tests and debugging.
    """

    ckpt_root: str = ""
    s3_endpoint: str = ""
    steps: int = 100
    save_every: int = 10
    keep_last: int = 3
    compression: str = "none"
    global_batch: int = 24
    lr: float = 3e-3
    seed: int = 0
    dim: int = 128
    layers: int = 2
    heads: int = 4
    vocab: int = 512
    seq_len: int = 32
    dist_backend: str = "auto"
    log_every: int = 1
    metrics_file: str = ""
    digest: bool = False


_CHOICES = {"compression": ("none", "zstd"), "dist_backend": ("auto", "nccl", "gloo")}
_HELP = {
    "ckpt_root": "checkpoint root: a path, file:// or s3:// URL (required)",
    "s3_endpoint": "S3 endpoint URL for MinIO/Ceph (empty: AWS_ENDPOINT_URL_S3 or AWS itself)",
    "steps": "train until this step",
    "save_every": "save every N steps (and at the last step)",
    "keep_last": "committed checkpoints to keep",
    "compression": "checkpoint compression",
    "global_batch": "sequences per step over all ranks (divisible by the world size)",
    "lr": "AdamW learning rate",
    "seed": "seed of model init and synthetic data",
    "dim": "transformer width",
    "layers": "transformer blocks (one FSDP unit each)",
    "heads": "attention heads (divide --dim)",
    "vocab": "vocabulary size of the synthetic sequences",
    "seq_len": "tokens per sequence",
    "dist_backend": "torch.distributed backend",
    "log_every": "log the loss every N steps",
    "metrics_file": "rank 0 appends JSON lines (resume/step/save events) here",
    "digest": "add a SHA-256 of the full state to resume/save metrics (gathers the state)",
}


def _env_name(field: str) -> str:
    return ENV_PREFIX + field.upper()


def _parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean (1/0, true/false), got {text!r}")


def build_parser(environ: dict[str, str] | None = None) -> argparse.ArgumentParser:
    """The command line; defaults come from ``TRAIN_*`` variables in ``environ`` (os.environ)."""
    environ = os.environ if environ is None else environ
    parser = argparse.ArgumentParser(
        prog="examples/train.py",
        description="FSDP2 trainer with shardstore checkpoints (async saves, resume on any world size). "
        "Every --flag can also be set as TRAIN_FLAG (e.g. --ckpt-root / TRAIN_CKPT_ROOT).",
    )
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        env = _env_name(f.name)
        kind = type(f.default)
        default: Any = f.default
        if env in environ:
            try:
                default = _parse_bool(environ[env]) if kind is bool else kind(environ[env])
            except (ValueError, argparse.ArgumentTypeError) as e:
                parser.error(f"{env}={environ[env]!r}: {e}")
        help_text = f"{_HELP[f.name]} [env {env}; default {default!r}]"
        if kind is bool:
            parser.add_argument(flag, type=_parse_bool, nargs="?", const=True, default=default, help=help_text)
        else:
            parser.add_argument(flag, type=kind, default=default, choices=_CHOICES.get(f.name), help=help_text)
    return parser


def parse_config(argv: list[str] | None = None, environ: dict[str, str] | None = None) -> TrainConfig:
    """Parse flags (over ``TRAIN_*`` variables) into a validated :class:`TrainConfig`."""
    parser = build_parser(environ)
    args = parser.parse_args(argv)
    config = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
    if not config.ckpt_root:
        parser.error("no checkpoint root: pass --ckpt-root or set TRAIN_CKPT_ROOT")
    for name in ("steps", "save_every", "keep_last", "global_batch", "log_every", "dim", "layers", "heads", "vocab", "seq_len"):
        if getattr(config, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(config, name)}")
    if config.dim % config.heads:
        parser.error(f"--dim {config.dim} is not divisible by --heads {config.heads}")
    if config.s3_endpoint and not config.ckpt_root.startswith("s3://"):
        parser.error(f"--s3-endpoint is set but the checkpoint root {config.ckpt_root!r} is not an s3:// URL")
    return config


# --- model and data (shardstore.demo's transformer and synthetic sequences) -------------------


def demo_config(config: TrainConfig) -> DemoConfig:
    """The :class:`shardstore.demo.DemoConfig` describing this run's model and data."""
    return DemoConfig(dim=config.dim, layers=config.layers, heads=config.heads, vocab=config.vocab,
                      seq=config.seq_len, batch=config.global_batch, seed=config.seed)


def build_model(config: TrainConfig) -> nn.Module:
    """The full (unsharded) model, initialised from ``config.seed``: identical on every rank."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        return TinyTransformer(demo_config(config))


def global_batch(step: int, config: TrainConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of ``step`` for all ranks: a pure function of (seed, step)."""
    return batch_for_step(step, demo_config(config))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy."""
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


# --- distributed set-up ---------------------------------------------------------------------


def init_distributed(config: TrainConfig) -> torch.device:
    """Join the process group torchrun describes; return this rank's device."""
    if "RANK" not in os.environ:
        raise SystemExit("examples/train.py runs under torchrun (e.g. torchrun --standalone --nproc-per-node 2 ...)")
    backend = config.dist_backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend, timeout=timedelta(minutes=10))
    return device


def shard_model(model: nn.Module, device: torch.device) -> nn.Module:
    """FSDP2: one unit per block plus the root, parameters sharded over all ranks."""
    model.to(device)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def storage_options(config: TrainConfig) -> dict[str, Any] | None:
    """``storage_options`` for the checkpoint root: only the endpoint; credentials stay in env."""
    return {"endpoint_url": config.s3_endpoint} if config.s3_endpoint else None


def state_digest(model: nn.Module, optimizer: torch.optim.Optimizer) -> str | None:
    """SHA-256 of the full model + optimizer state (collective; the digest on rank 0 only).

    Keys are parameter names, so the digest does not depend on the world size or sharding:
    equal digests before a save and after a restore on another world size mean a bit-exact
    round trip.
    """
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    if dist.get_rank() != 0:
        return None
    digest = hashlib.sha256()

    def feed(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key in sorted(value, key=str):
                feed(f"{prefix}/{key}", value[key])
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                feed(f"{prefix}/{i}", item)
        elif isinstance(value, torch.Tensor):
            t = value.detach().cpu().contiguous()
            digest.update(f"{prefix}:{t.dtype}:{tuple(t.shape)}".encode())
            digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            digest.update(f"{prefix}={value!r}".encode())

    feed("model", model_sd)
    feed("optimizer", optim_sd)
    return digest.hexdigest()


class Metrics:
    """Rank 0 appends JSON lines to ``path`` (when set) and logs."""

    def __init__(self, path: str) -> None:
        self.path = path if dist.get_rank() == 0 else ""

    def emit(self, **record: Any) -> None:
        if self.path:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")


class Preemption:
    """SIGTERM only sets a flag; the ranks agree on it at the next step boundary.

    The flag travels in the same all-reduce as the step's loss, so the agreement costs no extra
    collective: every rank stops (and saves) at the same step even when the signal reaches the
    nodes at different times, or only some of them.
    """

    def __init__(self) -> None:
        self.flag = False
        signal.signal(signal.SIGTERM, self._handler)

    def _handler(self, signum: int, frame: Any) -> None:
        self.flag = True


def reduce_step(loss: torch.Tensor, preemption: Preemption) -> tuple[float, bool]:
    """Mean loss over the ranks and whether any rank got SIGTERM (one all-reduce)."""
    t = torch.stack([loss.detach().float(), torch.tensor(float(preemption.flag), device=loss.device)])
    dist.all_reduce(t)
    return float(t[0].item()) / dist.get_world_size(), bool(t[1].item() > 0)


# --- the loop ---------------------------------------------------------------------------------


def train(config: TrainConfig) -> int:
    """Run (or resume) training up to ``config.steps``; return the process exit code."""
    device = init_distributed(config)
    rank, world = dist.get_rank(), dist.get_world_size()
    if config.global_batch % world:
        raise SystemExit(
            f"--global-batch {config.global_batch} is not divisible by the world size {world}; "
            "pick a global batch that every world size you run on divides"
        )
    local = config.global_batch // world
    model = shard_model(build_model(config), device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
    state = TrainState(model, optimizer, counters={"step": 0})
    metrics = Metrics(config.metrics_file)
    preemption = Preemption()

    with CheckpointManager(
        config.ckpt_root,
        keep_last=config.keep_last,
        async_save=True,
        compression=None if config.compression == "none" else config.compression,
        storage_options=storage_options(config),
    ) as mgr:
        restored = mgr.restore({"train": state})
        start = 0 if restored is None else int(state.counters["step"])
        if restored is not None and start != restored:
            raise StateMismatchError(f"checkpoint step {restored} under {config.ckpt_root} holds step counter {start}")
        if restored is None:
            logger.info("no checkpoint under %s: starting at step 1 on %d rank(s)", config.ckpt_root, world)
        else:
            logger.info("resumed from step %d under %s on %d rank(s)", start, config.ckpt_root, world)
            metrics.emit(event="resume", step=start, world_size=world,
                         digest=state_digest(model, optimizer) if config.digest else None)
        if start >= config.steps:
            logger.info("already at step %d of %d: nothing to do", start, config.steps)
            return 0

        step = start
        for step in range(start + 1, config.steps + 1):
            t0 = time.perf_counter()
            tokens, targets = global_batch(step, config)
            mine = slice(rank * local, (rank + 1) * local)
            loss = loss_fn(model(tokens[mine].to(device)), targets[mine].to(device))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            mean_loss, preempted = reduce_step(loss, preemption)
            metrics.emit(event="step", step=step, loss=mean_loss)
            if step % config.log_every == 0 and rank == 0:
                logger.info("step %d loss %.6f (%.3f s)", step, mean_loss, time.perf_counter() - t0)

            state.counters["step"] = step
            if preempted or step % config.save_every == 0 or step == config.steps:
                mgr.save(step, {"train": state})
                if config.digest:
                    metrics.emit(event="save", step=step, digest=state_digest(model, optimizer))
            if preempted:
                mgr.wait()
                logger.info("SIGTERM: saved step %d, exiting", step)
                metrics.emit(event="preempted", step=step)
                return 0
        mgr.wait()
        logger.info("done: step %d committed under %s", step, config.ckpt_root)
    return 0


def main(argv: list[str] | None = None) -> int:
    config = parse_config(argv)
    logging.basicConfig(
        level=logging.INFO if os.environ.get("RANK", "0") == "0" else logging.WARNING,
        format=f"[rank {os.environ.get('RANK', '?')}] %(asctime)s %(name)s: %(message)s",
    )
    try:
        return train(config)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
