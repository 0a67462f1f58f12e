"""``shardstore verify CKPT``: re-read every frame of a checkpoint and check its checksum.

The verb is a thin shell around :func:`shardstore.verify.verify_checkpoint`: it shows progress
on stderr (tqdm) while the frames are read, then prints a summary and every damaged tensor, or
the whole report as JSON with ``--json``. Exit status: 0 when everything checks out, 1 when
anything is damaged, 2 when the checkpoint cannot be verified at all (missing, bad index,
storage unreachable; printed by the dispatcher).
"""

from __future__ import annotations

import argparse

from shardstore.cli._common import add_output, add_storage_options, human, positive_int, print_json, progress
from shardstore.verify import VerifyReport, verify_checkpoint

NAME = "verify"
HELP = "re-read every record of a checkpoint and check its checksums; exit 1 on damage"

#: Exit status when the checkpoint is damaged (2 is reserved for errors).
EXIT_DAMAGED = 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory or URL (s3://..., file://...)")
    parser.add_argument("--threads", type=positive_int, default=0, help="parallel reader threads (default: per CPU, 2-8)")
    add_output(parser)
    add_storage_options(parser)


def _summary(report: VerifyReport) -> str:
    ratio = report.stored_bytes / report.raw_bytes if report.raw_bytes else 1.0
    lines = [
        f"checkpoint {report.checkpoint}: {'OK' if report.ok else 'DAMAGED'}",
        f"  {report.tensors} tensors ({report.chunks} chunks, {report.frames} frames) in {report.files} files, "
        f"{report.values} values",
        f"  {human(report.stored_bytes)} stored, {human(report.raw_bytes)} raw ({ratio:.3f} of raw); "
        f"read {human(report.bytes_read)} in {report.seconds:.2f} s",
    ]
    if report.ok:
        return "\n".join(lines)
    lines.append(
        f"  damaged: {len(report.damaged_tensors)} tensors, {len(report.damaged_files)} files, "
        f"{len(report.bad_values)} values"
    )
    for name in report.damaged_tensors:
        lines.append(f"  tensor {name!r}:")
        for d in (d for d in report.damage if d.tensor == name):
            frames = f"{d.frames} frame{'s' if d.frames != 1 else ''}"
            lines.append(
                f"    chunk at {list(d.chunk_offsets)}: file {d.file}, bytes [{d.start}, {d.end}) ({frames}): {d.reason}"
            )
    for p in report.file_problems:
        actual = "missing" if p.actual_size is None else f"{p.actual_size} bytes"
        lines.append(f"  file {p.file}: {p.reason} ({actual}, the index says {p.expected_size} bytes)")
    for v in report.bad_values:
        lines.append(f"  value {v}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    with progress(args, "verify") as bar:
        shown = 0

        def advance(done: int, total: int) -> None:
            nonlocal shown
            bar.set_total(total)
            bar.update(done - shown)
            shown = done

        report = verify_checkpoint(
            args.checkpoint, storage_options=args.storage_options, threads=args.threads, progress=advance
        )
    if args.json:
        print_json(report.to_dict())
    else:
        print(_summary(report))
    return 0 if report.ok else EXIT_DAMAGED
