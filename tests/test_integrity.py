"""Integrity: flipped bytes (compressed and raw frames), truncated and missing data files and a
damaged index are caught on load and by ``shardstore verify`` (library and command line)."""

from __future__ import annotations

import json
import os
import re

import msgpack
import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
import xxhash

from shardstore import (
    CorruptCheckpointError,
    InvalidCheckpointError,
    ShardReader,
    ShardWriter,
    TruncatedFileError,
)
from shardstore.cli import main
from shardstore.codec import Codec, decode_frame
from shardstore.config import INDEX_NAME
from shardstore.errors import unwrap_error
from shardstore.verify import verify_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

FRAME = 4096


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "wb": (torch.randn(64, 256, generator=g) * 0.02).bfloat16(),  # 8 byte-grouped frames
        "wf": torch.randn(1500, generator=g) * 0.02,  # 2 byte-grouped frames
        "ids": torch.randint(-(2**62), 2**62, (1024,), generator=g),  # 2 frames, stored raw
        "mask": torch.rand(3000, generator=g) > 0.5,  # 1 zstd frame
        "step": 9,
    }


def _target() -> dict:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in _state().items()}


def _save(path: str, compression: str | None) -> str:
    dcp.save(_state(), storage_writer=ShardWriter(path, compression=compression, frame_size=FRAME, threads=1, sync=False))
    return path


@pytest.fixture
def zstd_ckpt(tmp_path) -> str:
    return _save(str(tmp_path / "zstd"), "zstd")


@pytest.fixture
def raw_ckpt(tmp_path) -> str:
    return _save(str(tmp_path / "raw"), None)


def _data_file(ckpt: str) -> str:
    (name,) = [f for f in os.listdir(ckpt) if f.startswith("data-")]
    return name


def _frames(ckpt: str) -> list[tuple[str, int, int, int, int]]:
    """Every frame of the checkpoint as (tensor, frame id, codec, start, end), in file order."""
    index = ShardReader(ckpt).index
    out = []
    for fqn, t in index.tensors.items():
        pos = t.frame_pos
        for g in range(len(t.frame_len)):
            out.append((fqn, g, int(t.frame_codec[g]), int(pos[g]), int(pos[g] + t.frame_len[g])))
    return sorted(out, key=lambda f: f[3])


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def _load_error(ckpt: str) -> BaseException:
    with pytest.raises(BaseException) as info:  # DCP wraps it in CheckpointException
        dcp.load(_target(), storage_reader=ShardReader(ckpt))
    return unwrap_error(info.value)


def _verify_cli(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(["verify", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _assert_caught(ckpt: str, offset: int, tensor: str, capsys) -> None:
    """The flip at ``offset`` fails the load and the verify verb, both naming ``tensor``."""
    name = _data_file(ckpt)
    err = _load_error(ckpt)
    assert isinstance(err, CorruptCheckpointError), repr(err)
    msg = str(err)
    assert "checksum" in msg and ckpt in msg and name in msg and repr(tensor) in msg, msg
    start, end = map(int, re.search(r"bytes \[(\d+), (\d+)\)", msg).groups())
    assert start <= offset < end, (offset, msg)

    rc, out, _ = _verify_cli(capsys, ckpt, "--json")
    report = json.loads(out)
    assert rc == 1 and report["ok"] is False
    assert report["damaged_tensors"] == [tensor] and report["damaged_files"] == [name]
    (d,) = report["damage"]
    assert d["file"] == name and d["start"] <= offset < d["end"] and d["frames"] == 1, d


def _harmful(ckpt: str, tensor: str, offset: int) -> bool:
    """Whether flipping ``offset`` changes what its frame decodes to (or makes it undecodable).

    A few bits of a zstd stream do not influence the output (padding of entropy-coded bits); a
    flip there leaves the data intact, and no checksum of the raw bytes can (or needs to) see it.
    """
    index = ShardReader(ckpt).index
    t = index.tensors[tensor]
    pos = t.frame_pos
    (g,) = [g for g in range(len(pos)) if pos[g] <= offset < pos[g] + t.frame_len[g]]
    data = bytearray(open(os.path.join(ckpt, _data_file(ckpt)), "rb").read())
    stored = data[pos[g] : pos[g] + t.frame_len[g]]
    raw_len = min(index.frame_size, t.raw_nbytes(0) - (g - int(t.frame_start[0])) * index.frame_size)
    before = bytes(decode_frame(bytes(stored), int(t.frame_codec[g]), raw_len))
    stored[offset - pos[g]] ^= 0xFF
    try:
        return bytes(decode_frame(bytes(stored), int(t.frame_codec[g]), raw_len)) != before
    except CorruptCheckpointError:
        return True


# -- flipped bytes -----------------------------------------------------------------------------


def _offset(ckpt: str, where: str) -> tuple[int, str]:
    frames = _frames(ckpt)
    by = lambda name: [f for f in frames if f[0] == name]  # noqa: E731
    if where == "plane-table":  # first word of a byte-grouped frame's plane table
        return by("wb")[3][3], "wb"
    if where == "raw-plane":  # inside the (raw) lowest mantissa plane of a bf16 frame
        return by("wb")[5][3] + 8 + 1000, "wb"
    if where == "zstd-plane":  # inside the zstd-compressed exponent plane of a bf16 frame
        start, end = by("wb")[2][3:]
        for off in range((start + end) // 2, end):
            if _harmful(ckpt, "wb", off):
                return off, "wb"
    if where == "fp32-plane":
        return by("wf")[1][4] - 1, "wf"  # the last byte of the last fp32 frame
    if where == "zstd-frame":  # a plain zstd frame (bool)
        (f,) = by("mask")
        assert f[2] == Codec.ZSTD
        for off in range((f[3] + f[4]) // 2, f[4]):
            if _harmful(ckpt, "mask", off):
                return off, "mask"
    if where == "raw-frame":  # random integers: frames stored raw even in a zstd checkpoint
        f = by("ids")[1]
        assert f[2] == Codec.RAW
        return f[3] + 100, "ids"
    if where == "first-byte":
        return frames[0][3], frames[0][0]
    if where == "last-byte":
        return frames[-1][4] - 1, frames[-1][0]
    if where == "middle":
        f = frames[len(frames) // 2]
        return (f[3] + f[4]) // 2, f[0]
    raise AssertionError(where)


@pytest.mark.parametrize(
    "where", ["plane-table", "raw-plane", "zstd-plane", "fp32-plane", "zstd-frame", "raw-frame", "first-byte", "last-byte"]
)
def test_flipped_byte_in_compressed_checkpoint_is_caught(zstd_ckpt, where, capsys):
    offset, tensor = _offset(zstd_ckpt, where)
    _flip(os.path.join(zstd_ckpt, _data_file(zstd_ckpt)), offset)
    _assert_caught(zstd_ckpt, offset, tensor, capsys)


@pytest.mark.parametrize("where", ["first-byte", "middle", "last-byte"])
def test_flipped_byte_in_uncompressed_checkpoint_is_caught(raw_ckpt, where, capsys):
    offset, tensor = _offset(raw_ckpt, where)
    _flip(os.path.join(raw_ckpt, _data_file(raw_ckpt)), offset)
    _assert_caught(raw_ckpt, offset, tensor, capsys)


def test_every_sampled_flip_is_reported_where_it_is_or_is_harmless(zstd_ckpt):
    """Flip bytes all over the data file: verify names the tensor and range of each, unless the
    byte is record padding or a bit the zstd decoder ignores (then the data is intact)."""
    path = os.path.join(zstd_ckpt, _data_file(zstd_ckpt))
    frames = _frames(zstd_ckpt)
    size = os.path.getsize(path)
    caught = harmless = 0
    for offset in range(0, size, max(1, size // 300)):
        _flip(path, offset)
        report = verify_checkpoint(zstd_ckpt, threads=2)
        _flip(path, offset)
        owner = [f for f in frames if f[3] <= offset < f[4]]
        if not owner:
            assert report.ok, (offset, report.damage)  # padding between records
            harmless += 1
            continue
        (fqn, *_rest) = owner[0]
        if report.ok:
            assert not _harmful(zstd_ckpt, fqn, offset), offset
            harmless += 1
            continue
        (d,) = report.damage
        assert (d.tensor, d.frames) == (fqn, 1) and d.start <= offset < d.end, (offset, d)
        caught += 1
    assert caught >= 0.9 * (caught + harmless), (caught, harmless)


def test_flip_in_a_referenced_base_checkpoint_is_reported_by_the_loading_step(tmp_path):
    root = tmp_path / "run"
    base = _save(str(root / "step-1"), "zstd")
    dcp.save(_state(), storage_writer=ShardWriter(  # unchanged state: every chunk references step-1
        str(root / "step-2"), compression="zstd", frame_size=FRAME, threads=1, sync=False, incremental_base="step-1"))
    assert {f.base for f in ShardReader(str(root / "step-2")).index.files} == {"step-1"}
    offset, tensor = _offset(base, "raw-frame")
    _flip(os.path.join(base, _data_file(base)), offset)
    report = verify_checkpoint(str(root / "step-2"))
    assert report.damaged_tensors == [tensor]
    (d,) = report.damage
    assert d.file == f"../step-1/{_data_file(base)}" and d.reason == "checksum mismatch" and d.start <= offset < d.end


def test_reader_with_verify_off_does_not_check(zstd_ckpt):
    offset, _ = _offset(zstd_ckpt, "raw-frame")
    _flip(os.path.join(zstd_ckpt, _data_file(zstd_ckpt)), offset)
    out = _target()
    dcp.load(out, storage_reader=ShardReader(zstd_ckpt, verify=False))  # benchmarks only
    assert not torch.equal(out["ids"], _state()["ids"]) and torch.equal(out["wb"], _state()["wb"])


# -- truncated, missing and longer data files ----------------------------------------------------


def test_truncated_data_file(zstd_ckpt, capsys):
    path = os.path.join(zstd_ckpt, _data_file(zstd_ckpt))
    frames = _frames(zstd_ckpt)
    cut = (frames[len(frames) // 2][3] + frames[len(frames) // 2][4]) // 2  # inside a frame
    full = os.path.getsize(path)
    os.truncate(path, cut)
    after = {f[0] for f in frames if f[4] > cut}

    err = _load_error(zstd_ckpt)
    assert isinstance(err, TruncatedFileError), repr(err)
    assert "truncated" in str(err) and _data_file(zstd_ckpt) in str(err) and zstd_ckpt in str(err), str(err)

    report = verify_checkpoint(zstd_ckpt)
    assert set(report.damaged_tensors) == after
    assert all(d.reason.startswith("truncated") and d.end > cut for d in report.damage)
    assert sum(d.frames for d in report.damage) == sum(1 for f in frames if f[4] > cut)
    (p,) = report.file_problems
    assert (p.expected_size, p.actual_size, p.reason) == (full, cut, "truncated")

    rc, out, _ = _verify_cli(capsys, zstd_ckpt)
    assert rc == 1 and "DAMAGED" in out and "truncated" in out
    assert all(f"tensor {t!r}" in out for t in after)


def test_missing_data_file_damages_every_tensor(zstd_ckpt, capsys):
    os.unlink(os.path.join(zstd_ckpt, _data_file(zstd_ckpt)))
    report = verify_checkpoint(zstd_ckpt)
    assert report.damaged_tensors == ["ids", "mask", "wb", "wf"]
    assert report.file_problems[0].actual_size is None and report.bytes_read == 0
    rc, out, _ = _verify_cli(capsys, zstd_ckpt, "--json")
    assert rc == 1 and json.loads(out)["file_problems"][0]["reason"] == "missing"


def test_data_file_longer_than_the_index_says_is_reported(zstd_ckpt, capsys):
    path = os.path.join(zstd_ckpt, _data_file(zstd_ckpt))
    with open(path, "ab") as f:
        f.write(b"\0" * 10)
    report = verify_checkpoint(zstd_ckpt)
    assert report.damage == [] and not report.ok
    assert report.file_problems[0].reason == "longer than the index says"
    assert _verify_cli(capsys, zstd_ckpt)[0] == 1


# -- a clean checkpoint; progress; output ------------------------------------------------------


def test_clean_checkpoint_verifies_and_reports_progress(zstd_ckpt, capsys):
    calls = []
    report = verify_checkpoint(zstd_ckpt, threads=2, max_range=2 * FRAME, progress=lambda d, t: calls.append((d, t)))
    assert report.ok and report.damage == [] and report.tensors == 4 and report.values == 1
    index = ShardReader(zstd_ckpt).index
    assert report.frames == sum(len(t.frame_len) for t in index.tensors.values()) == 13
    assert report.stored_bytes == index.stored_nbytes() <= report.bytes_read <= os.path.getsize(
        os.path.join(zstd_ckpt, _data_file(zstd_ckpt)))
    totals = {t for _, t in calls}
    assert len(totals) == 1 and calls[0][0] == 0 and calls[-1][0] == calls[-1][1] == report.bytes_read
    assert len(calls) >= 3 and all(a[0] <= b[0] for a, b in zip(calls, calls[1:]))

    rc, out, err = _verify_cli(capsys, zstd_ckpt)
    assert rc == 0 and out.startswith(f"checkpoint {zstd_ckpt}: OK") and "13 frames" in out and err == ""
    rc, out, _ = _verify_cli(capsys, zstd_ckpt, "--json", "--threads", "1")
    assert rc == 0 and json.loads(out)["ok"] is True


def test_damage_is_listed_per_tensor_in_text_output(zstd_ckpt, capsys):
    path = os.path.join(zstd_ckpt, _data_file(zstd_ckpt))
    for where in ("raw-plane", "raw-frame"):
        _flip(path, _offset(zstd_ckpt, where)[0])
    rc, out, _ = _verify_cli(capsys, zstd_ckpt)
    assert rc == 1
    assert "damaged: 2 tensors, 1 files" in out and "tensor 'wb':" in out and "tensor 'ids':" in out
    assert out.count("checksum mismatch") == 2


# -- a damaged index -----------------------------------------------------------------------------


def test_garbage_index_is_a_clear_error_for_verify(zstd_ckpt, capsys):
    with open(os.path.join(zstd_ckpt, INDEX_NAME), "r+b") as f:
        f.write(b"\xc1garbage")
    with pytest.raises(InvalidCheckpointError, match=re.escape(zstd_ckpt)):
        verify_checkpoint(zstd_ckpt)
    rc, out, err = _verify_cli(capsys, zstd_ckpt)
    assert rc == 2 and out == "" and err.startswith("shardstore verify: error: ") and err.count("\n") == 1


def _edit_index(ckpt: str, edit) -> None:
    """Edit the decoded index and write it back re-sealed (a valid ``index_hash`` over the edited
    map), so that the edit must be caught by the index's own consistency checks."""
    path = os.path.join(ckpt, INDEX_NAME)
    doc = msgpack.unpackb(open(path, "rb").read(), raw=False)
    edit(doc)
    doc.pop("index_hash")
    doc["index_hash"] = xxhash.xxh3_128_digest(msgpack.packb(doc, use_bin_type=True))
    open(path, "wb").write(msgpack.packb(doc, use_bin_type=True))


def _set_frame_len(doc: dict, value: int) -> None:
    lens = np.frombuffer(doc["tensors"]["wb"]["frame_len"], dtype="<i8").copy()
    lens[0] = value
    doc["tensors"]["wb"]["frame_len"] = lens.tobytes()


def _set_chunk_rows(doc: dict, rows: int) -> None:
    sizes = np.frombuffer(doc["tensors"]["wb"]["sizes"], dtype="<i8").copy()
    sizes[0] = rows
    doc["tensors"]["wb"]["sizes"] = sizes.tobytes()


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: _set_frame_len(d, 1 << 40), "past the end of their data file"),
        (lambda d: d["tensors"]["wb"].update(frame_codec=b"\x09" * 8), "unknown frame codec"),
        (lambda d: _set_chunk_rows(d, 32), "frame counts that do not match"),
    ],
    ids=["frame-past-file-end", "unknown-codec", "frames-vs-chunk-size"],
)
def test_inconsistent_index_is_refused_when_opened(zstd_ckpt, edit, message):
    """Well-formed msgpack whose tables contradict each other: refused before any data is read."""
    _edit_index(zstd_ckpt, edit)
    with pytest.raises(InvalidCheckpointError, match=message) as info:
        ShardReader(zstd_ckpt)
    assert zstd_ckpt in str(info.value)


def test_index_that_fails_its_own_checksum_is_refused(zstd_ckpt):
    path = os.path.join(zstd_ckpt, INDEX_NAME)
    doc = msgpack.unpackb(open(path, "rb").read(), raw=False)
    doc["values"]["step"] = msgpack.packb(10)  # a plausible value, not re-sealed
    open(path, "wb").write(msgpack.packb(doc, use_bin_type=True))
    with pytest.raises(InvalidCheckpointError, match="checksum") as info:
        ShardReader(zstd_ckpt)
    assert zstd_ckpt in str(info.value)


def test_every_flipped_byte_in_the_index_is_an_invalid_checkpoint(zstd_ckpt):
    """The index carries the checksums of the data; a flip in the index itself must not pass as
    a valid index (it could change a value, a shape, or send reads past a file's end)."""
    path = os.path.join(zstd_ckpt, INDEX_NAME)
    orig = open(path, "rb").read()
    accepted = []
    for offset in range(0, len(orig), 3):
        damaged = bytearray(orig)
        damaged[offset] ^= 0x01
        open(path, "wb").write(damaged)
        try:
            ShardReader(zstd_ckpt)
        except InvalidCheckpointError:
            continue
        accepted.append(offset)
    open(path, "wb").write(orig)
    assert not accepted, f"{len(accepted)} of {len(orig) // 3} single-bit flips in the index were accepted"


# -- S3 ----------------------------------------------------------------------------------------


def test_verify_over_s3_finds_a_flipped_byte(s3_url, capsys):
    url, opts = s3_url.url, s3_url.storage_options
    dcp.save(_state(), storage_writer=ShardWriter(url, storage_options=opts, compression="zstd", frame_size=FRAME, threads=1))
    rc, out, _ = _verify_cli(capsys, url, "--storage-options", json.dumps(opts), "--json")
    assert rc == 0 and json.loads(out)["frames"] == 13

    index = ShardReader(url, storage_options=opts).index
    t = index.tensors["ids"]
    name = index.files[int(t.file[0])].path
    client, key = s3_url.client(), f"{s3_url.prefix}/{name}"
    data = bytearray(client.get_object(Bucket=s3_url.bucket, Key=key)["Body"].read())
    offset = int(t.pos[0]) + 5
    data[offset] ^= 0x10
    client.put_object(Bucket=s3_url.bucket, Key=key, Body=bytes(data))

    rc, out, _ = _verify_cli(capsys, url, "--storage-options", json.dumps(opts), "--json")
    report = json.loads(out)
    assert rc == 1 and report["damaged_tensors"] == ["ids"]
    assert report["damage"][0]["start"] <= offset < report["damage"][0]["end"]
