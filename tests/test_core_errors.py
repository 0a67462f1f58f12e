"""Single-process checks of the core: bad input gets a clear error, values need no pickle."""

from __future__ import annotations

import os

import msgpack
import pytest
import torch
import torch.distributed.checkpoint as dcp

from shardstore import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    InvalidCheckpointError,
    ShardReader,
    ShardWriter,
    TruncatedFileError,
    UnsupportedValueError,
)
from shardstore.codec import frame_hash
from shardstore.config import INDEX_NAME
from shardstore.errors import unwrap_error

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class raises_inside:
    """Like ``pytest.raises`` for the error DCP wraps in its ``CheckpointException``."""

    def __init__(self, exc_type: type[BaseException], match: str) -> None:
        self.exc_type, self.match = exc_type, match

    def __enter__(self):
        return self

    def __exit__(self, et, ev, tb):
        assert ev is not None, f"did not raise {self.exc_type.__name__}"
        inner = unwrap_error(ev)
        assert isinstance(inner, self.exc_type), f"{type(inner).__name__}: {inner}"
        import re

        assert re.search(self.match, str(inner)), f"{self.match!r} not in {str(inner)!r}"
        self.value = inner
        return True


def _state() -> dict:
    torch.manual_seed(0)
    return {
        "w": torch.randn(64, 32),
        "b": torch.randn(32).bfloat16(),
        "step": 3,
        "sched": {"last_epoch": 7, "base_lrs": [0.1, 0.2], "betas": (0.9, 0.95), "name": None},
        "rng": (3, (1, 2, 3), None),
    }


@pytest.fixture
def ckpt(tmp_path) -> str:
    path = str(tmp_path / "ckpt")
    dcp.save(_state(), storage_writer=ShardWriter(path))
    return path


def _target() -> dict:
    return {"w": torch.zeros(64, 32), "b": torch.zeros(32, dtype=torch.bfloat16), "step": 0,
            "sched": {"last_epoch": 0, "base_lrs": [], "betas": (), "name": "x"}, "rng": None}


def test_round_trip_keeps_values_and_their_types(ckpt):
    state = _target()
    dcp.load(state, storage_reader=ShardReader(ckpt))
    ref = _state()
    assert torch.equal(state["w"], ref["w"]) and torch.equal(state["b"], ref["b"])
    assert state["step"] == 3 and state["rng"] == (3, (1, 2, 3), None)
    assert state["sched"] == ref["sched"] and isinstance(state["sched"]["betas"], tuple)


def test_bf16_checkpoint_loads_into_fp32_model(ckpt):
    state = _target()
    state["b"] = torch.zeros(32)
    dcp.load(state, storage_reader=ShardReader(ckpt))
    assert state["b"].dtype == torch.float32 and torch.equal(state["b"], _state()["b"].float())


def test_index_is_msgpack_and_holds_no_pickle(ckpt):
    raw = open(os.path.join(ckpt, INDEX_NAME), "rb").read()
    doc = msgpack.unpackb(raw, raw=False)
    assert doc["format"] == "shardstore" and doc["version"] == 1
    assert msgpack.unpackb(doc["values"]["step"]) == 3
    for key, value in doc["values"].items():
        assert not value.startswith(b"\x80"), f"{key} looks like a pickle"  # pickle's PROTO opcode
        msgpack.unpackb(value, strict_map_key=False)


def test_unstorable_value_is_refused_at_save_naming_its_key(tmp_path):
    class Opaque:
        pass

    with raises_inside(UnsupportedValueError, r"'extra.obj'.*without pickle"):
        dcp.save({"w": torch.ones(2), "extra": {"obj": Opaque()}}, storage_writer=ShardWriter(str(tmp_path / "c")))
    assert not os.path.exists(tmp_path / "c" / INDEX_NAME)


def test_missing_path(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        ShardReader(str(tmp_path / "nope"))


def test_directory_that_is_not_a_checkpoint(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(CheckpointNotFoundError, match="not a shardstore checkpoint"):
        ShardReader(str(tmp_path))


def test_unfinished_save_is_not_a_checkpoint(ckpt):
    os.unlink(os.path.join(ckpt, INDEX_NAME))
    with pytest.raises(CheckpointNotFoundError, match="unfinished save"):
        ShardReader(ckpt)


def _rewrite_index(ckpt: str, edit) -> None:
    """Edit the index and re-seal it with a matching index_hash, as a deliberate forger would."""
    path = os.path.join(ckpt, INDEX_NAME)
    doc = msgpack.unpackb(open(path, "rb").read(), raw=False)
    doc.pop("index_hash")
    edit(doc)
    doc["index_hash"] = frame_hash(msgpack.packb(doc, use_bin_type=True))
    open(path, "wb").write(msgpack.packb(doc, use_bin_type=True))


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda p: open(p, "r+b").truncate(os.path.getsize(p) // 2), "not valid msgpack"),
        (lambda p: open(p, "wb").write(os.urandom(300)), "not a shardstore index|not valid msgpack"),
        (lambda p: open(p, "wb").write(b""), "not valid msgpack|not a shardstore index"),
    ],
    ids=["truncated", "garbage", "empty"],
)
def test_damaged_index(ckpt, damage, message):
    damage(os.path.join(ckpt, INDEX_NAME))
    with pytest.raises(InvalidCheckpointError, match=message):
        ShardReader(ckpt)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d.update(version=99), "format version 99"),
        (lambda d: d["files"][0].update(path="../../etc/passwd"), "leaves the checkpoint"),
        (lambda d: d["files"][0].update(path="/etc/passwd"), "leaves the checkpoint"),
        (lambda d: d["tensors"]["w"].update(dtype="evil"), "unknown dtype"),
        (lambda d: d["tensors"]["w"].update(pos=b"\x00" * 3), "has 3 bytes|has 0 bytes|expected"),
        (lambda d: d.update(world_size="two"), "world_size"),
        (lambda d: d["files"][0].update(base="../x"), "leaves"),
    ],
    ids=["version", "dotdot", "absolute", "dtype", "short-array", "type", "base"],
)
def test_invalid_index_fields(ckpt, edit, message):
    _rewrite_index(ckpt, edit)
    with pytest.raises(InvalidCheckpointError, match=message):
        ShardReader(ckpt)


def test_index_damage_that_stays_well_formed_is_caught_by_the_index_hash(ckpt):
    path = os.path.join(ckpt, INDEX_NAME)
    doc = msgpack.unpackb(open(path, "rb").read(), raw=False)
    doc["values"]["step"] = msgpack.packb(4)  # a plausible value, stale index_hash
    open(path, "wb").write(msgpack.packb(doc, use_bin_type=True))
    with pytest.raises(InvalidCheckpointError, match="index checksum mismatch"):
        ShardReader(ckpt)


def test_unknown_value_extension_type_is_an_error_not_code(ckpt):
    _rewrite_index(ckpt, lambda d: d["values"].update(step=msgpack.packb(msgpack.ExtType(42, b"x"))))
    with raises_inside(InvalidCheckpointError, "extension type 42"):
        dcp.load(_target(), storage_reader=ShardReader(ckpt))


def _data_files(ckpt: str) -> list[str]:
    return sorted(os.path.join(ckpt, f) for f in os.listdir(ckpt) if f.startswith("data-"))


def test_missing_data_file(ckpt):
    for f in _data_files(ckpt):
        os.unlink(f)
    with raises_inside(CorruptCheckpointError, r"data file data-.*\.bin of checkpoint .* is missing"):
        dcp.load(_target(), storage_reader=ShardReader(ckpt))


def test_short_data_file(ckpt):
    for f in _data_files(ckpt):
        os.truncate(f, os.path.getsize(f) - 10)
    with raises_inside(TruncatedFileError, "truncated"):
        dcp.load(_target(), storage_reader=ShardReader(ckpt))


def test_flipped_byte_is_a_checksum_error_naming_tensor_file_and_range(ckpt):
    f = _data_files(ckpt)[0]
    with open(f, "r+b") as fh:
        fh.seek(100)
        b = fh.read(1)
        fh.seek(100)
        fh.write(bytes([b[0] ^ 0x40]))
    with raises_inside(CorruptCheckpointError, r"checksum mismatch .*file data-.*tensor '(w|b)', bytes \[\d+, \d+\)"):
        dcp.load(_target(), storage_reader=ShardReader(ckpt))


def test_missing_key_and_wrong_shape_are_clear(ckpt):
    state = _target()
    state["not_saved"] = torch.zeros(3)
    with raises_inside(RuntimeError, "Missing key in checkpoint state_dict: not_saved"):
        dcp.load(state, storage_reader=ShardReader(ckpt))
    state = _target()
    state["w"] = torch.zeros(64, 31)
    with raises_inside(ValueError, "(?i)size mismatch"):
        dcp.load(state, storage_reader=ShardReader(ckpt))


def test_save_over_committed_checkpoint_refuses_or_replaces_atomically(ckpt):
    old_files = _data_files(ckpt)
    with raises_inside(CheckpointExistsError, "already holds a committed checkpoint"):
        dcp.save({"w": torch.ones(64, 32)}, storage_writer=ShardWriter(ckpt))
    assert _data_files(ckpt) == old_files  # refused before anything was written
    dcp.save({"w": torch.ones(64, 32)}, storage_writer=ShardWriter(ckpt, overwrite=True))
    assert not set(old_files) & set(_data_files(ckpt))  # the replaced checkpoint's data is gone
    state = {"w": torch.zeros(64, 32)}
    dcp.load(state, storage_reader=ShardReader(ckpt))
    assert torch.equal(state["w"], torch.ones(64, 32))


def test_memory_fsspec_backend_round_trip():
    path = "memory://shardstore-test/ckpt"
    dcp.save(_state(), storage_writer=ShardWriter(path, compression="zstd"))
    state = _target()
    dcp.load(state, storage_reader=ShardReader(path))
    assert torch.equal(state["w"], _state()["w"]) and state["sched"] == _state()["sched"]
    with pytest.raises(CheckpointExistsError):
        ShardWriter(path).set_up_storage_writer(True)
