"""``shardstore demo``: train on N CPU ranks, save, resume on M ranks, compare the loss curves."""

from __future__ import annotations

import argparse

NAME = "demo"
HELP = "train a small FSDP2 transformer on N CPU ranks, save, resume on M ranks, check the loss"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int, default=4, help="ranks of the first run (default 4)")
    p.add_argument("--resume-ranks", type=int, default=2, help="ranks of the resumed run (default 2)")
    p.add_argument("--steps", type=int, default=16, help="training steps in all (default 16)")
    p.add_argument("--save-every", type=int, default=4, help="save every k steps (default 4)")
    p.add_argument("--crash-at", type=int, default=14, help="simulated crash after this step (default 14)")
    p.add_argument("--path", default="./checkpoints", help="checkpoint root (default ./checkpoints; any URL works)")
    p.add_argument("--dim", type=int, default=None, help="model width (default 128)")
    p.add_argument("--layers", type=int, default=None, help="transformer blocks (default 2)")
    p.add_argument("--compression", choices=["zstd"], default=None, help="compress checkpoints")


def run(args: argparse.Namespace) -> int:
    from shardstore.demo import config_from_args, run_demo

    cfg = config_from_args(**vars(args))
    return 0 if run_demo(cfg) else 1
