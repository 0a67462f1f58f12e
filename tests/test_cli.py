"""The command line, run in-process through ``shardstore.cli.main``: every verb, text and JSON."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load as safetensors_load
from safetensors.torch import load_file, save_file

from shardstore import ShardReader, ShardWriter
from shardstore.backends import open_backend
from shardstore.cli import main
from shardstore.config import INDEX_NAME
from shardstore.manager import CheckpointManager
from shardstore.reader import load_index

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _state(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    return {
        "model": {
            "embed": torch.randn(50, 16),
            "layers": {"0": {"w": torch.randn(16, 16), "b": torch.randn(16)}, "1": {"w": torch.randn(16, 16)}},
            "head": torch.randn(16, 8).to(torch.bfloat16),
        },
        "ids": torch.arange(12, dtype=torch.int64),
        "step": 42,
        "sched": {"lr": 0.5, "name": "cosine"},
    }


def _save(path, state: dict, **options) -> str:
    dcp.save(state, storage_writer=ShardWriter(path, sync=False, **options), no_dist=True)
    return str(path)


def _load(path, like: dict, **kw) -> dict:
    out = {k: torch.zeros_like(v) for k, v in like.items()}
    dcp.load(out, storage_reader=ShardReader(path, **kw), no_dist=True)
    return out


def _flat(state: dict) -> dict[str, torch.Tensor]:
    out = {}

    def walk(prefix: str, obj) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}{k}.", v)
        elif isinstance(obj, torch.Tensor):
            out[prefix[:-1]] = obj

    walk("", state)
    return out


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(argv))
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


@pytest.fixture
def ckpt(tmp_path) -> str:
    return _save(tmp_path / "ckpt", _state(), compression="zstd")


def test_inspect_lists_tensors_and_values(capsys, ckpt):
    rc, out, err = cli(capsys, "inspect", ckpt, "--json")
    assert rc == 0 and err == ""
    info = json.loads(out)
    tensors = {t["name"]: t for t in info["tensors"]}
    assert sorted(tensors) == sorted(_flat(_state()))
    head = tensors["model.head"]
    assert head["dtype"] == "bfloat16" and head["shape"] == [16, 8] and head["chunks"] == 1
    assert head["raw_bytes"] == 16 * 8 * 2 and head["stored_bytes"] > 0
    assert info["world_size"] == 1 and info["raw_bytes"] == sum(t["raw_bytes"] for t in info["tensors"])
    values = {v["name"]: v for v in info["values"]}
    assert values["step"]["repr"] == "42" and values["sched.name"]["repr"] == "'cosine'"

    rc, out, _ = cli(capsys, "inspect", ckpt, "--prefix", "model.layers")
    assert rc == 0
    lines = out.splitlines()
    assert any(line.split()[:3] == ["model.layers.0.w", "float32", "16x16"] for line in lines)
    assert not any(line.startswith("model.embed") for line in lines)


def test_export_and_import_through_the_cli(capsys, ckpt, tmp_path):
    out = tmp_path / "m.safetensors"
    rc, text, err = cli(capsys, "export", ckpt, str(out), "--prefix", "model.", "--strip-prefix", "model.",
                        "--dtype", "fp16", "--json")
    assert rc == 0 and err == ""
    assert json.loads(text)["tensors"] == 5
    loaded = load_file(str(out))
    for name, t in _flat(_state()["model"]).items():
        assert loaded[name].dtype == torch.float16 and torch.equal(loaded[name], t.to(torch.float16)), name

    # Round trip through import: the checkpoint holds exactly the file's tensors.
    rc, text, _ = cli(capsys, "import", str(out), str(tmp_path / "back"), "--add-prefix", "model.")
    assert rc == 0 and "5 tensors" in text
    back = _load(tmp_path / "back", {f"model.{k}": v for k, v in loaded.items()})
    for name, t in loaded.items():
        assert torch.equal(back[f"model.{name}"], t)

    rc, _, err = cli(capsys, "export", ckpt, str(out))
    assert rc == 2 and "already exists; pass --overwrite" in err
    rc, _, err = cli(capsys, "export", ckpt, str(tmp_path / "x.safetensors"), "--prefix", "nope")
    assert rc == 2 and err.strip() == "shardstore export: error: the checkpoint has no tensors starting with 'nope'"


def test_diff_finds_exactly_the_changed_tensors(capsys, tmp_path, ckpt):
    b_state = _state()
    b_state["model"]["layers"]["0"]["b"][3] += 0.25
    b_state["model"]["head"][0, 0] = 7.0
    b_state["ids"] = b_state["ids"].to(torch.int32)
    del b_state["model"]["layers"]["1"]
    b_state["model"]["extra"] = torch.ones(2)
    b_state["sched"]["lr"] = 0.25
    b = _save(tmp_path / "b", b_state)

    rc, out, err = cli(capsys, "diff", ckpt, b, "--json")
    assert rc == 1 and err == ""
    d = json.loads(out)
    assert d["only_a"] == ["model.layers.1.w"] and d["only_b"] == ["model.extra"]
    changed = {c["name"]: c for c in d["changed"]}
    assert sorted(changed) == ["ids", "model.head", "model.layers.0.b"]
    assert changed["model.layers.0.b"]["reason"] == "values"
    assert changed["model.layers.0.b"]["max_abs_diff"] == pytest.approx(0.25, abs=1e-6)
    head_before = float(_state()["model"]["head"][0, 0])
    assert changed["model.head"]["max_abs_diff"] == pytest.approx(abs(7.0 - head_before), rel=1e-6)
    assert changed["ids"]["reason"] == "dtype" and changed["ids"]["max_abs_diff"] == 0.0
    assert d["values_changed"] == ["sched.lr"]
    assert d["same"] == 2  # model.embed, model.layers.0.w

    rc, out, _ = cli(capsys, "diff", ckpt, b)
    assert rc == 1 and "~ model.layers.0.b  max abs diff 0.25" in out and "- model.layers.1.w  (only in A)" in out

    same = _save(tmp_path / "same", _state())  # other compression and files, same values
    rc, out, _ = cli(capsys, "diff", ckpt, same)
    assert rc == 0 and out.startswith("identical: 6 same")


def test_cp_local_to_s3_and_back(capsys, ckpt, tmp_path, s3_url):
    opts = json.dumps(s3_url.storage_options)
    remote = f"{s3_url.url}/copy"
    rc, out, err = cli(capsys, "cp", ckpt, remote, "--dst-options", opts, "--json")
    assert rc == 0 and err == ""
    assert json.loads(out)["files"] == len(load_index(open_backend(ckpt)).files)
    keys = s3_url.keys()
    assert f"{s3_url.prefix}/copy/{INDEX_NAME}" in keys and not s3_url.open_uploads()

    # The S3 copy is a checkpoint every verb reads.
    rc, out, _ = cli(capsys, "inspect", remote, "--storage-options", opts, "--json")
    assert rc == 0 and len(json.loads(out)["tensors"]) == 6
    rc, _, _ = cli(capsys, "export", remote, f"{s3_url.url}/model.safetensors", "--storage-options", opts)
    assert rc == 0
    exported = safetensors_load(s3_url.backend().read_small("model.safetensors"))
    assert sorted(exported) == sorted(_flat(_state()))
    assert all(torch.equal(exported[k], v) for k, v in _flat(_state()).items())

    rc, out, _ = cli(capsys, "cp", remote, str(tmp_path / "back"), "--src-options", opts, "--verify", "--json")
    assert rc == 0 and json.loads(out)["verify"]["ok"]
    for name in os.listdir(ckpt):  # byte-identical files, same names
        assert (tmp_path / "back" / name).read_bytes() == open(os.path.join(ckpt, name), "rb").read()
    flat = _flat(_state())
    back = _load(tmp_path / "back", flat)
    for k, v in flat.items():
        assert torch.equal(back[k], v), k

    # A damaged copy: verify names the tensor; cp --verify fails the same way.
    data = sorted(f for f in os.listdir(tmp_path / "back") if f.startswith("data-"))[0]
    with open(tmp_path / "back" / data, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    rc, out, _ = cli(capsys, "verify", str(tmp_path / "back"), "--json")
    assert rc == 1 and data in json.loads(out)["damaged_files"]
    rc, out, _ = cli(capsys, "cp", str(tmp_path / "back"), str(tmp_path / "again"), "--verify")
    assert rc == 1 and "verified the copy: DAMAGED" in out

    rc, _, err = cli(capsys, "cp", ckpt, remote, "--dst-options", opts)
    assert rc == 2 and "already holds a committed checkpoint" in err
    rc, _, err = cli(capsys, "cp", ckpt, ckpt)
    assert rc == 2 and "same place" in err


def test_cp_materializes_incremental_references(capsys, tmp_path):
    root = tmp_path / "run"
    base = _save(root / "step-000000000001", _state())
    changed = _state()
    changed["model"]["embed"][0, 0] = 5.0
    inc = _save(root / "step-000000000002", changed, incremental_base="step-000000000001")
    assert any(f.base for f in load_index(open_backend(inc)).files), "the writer made no references"

    rc, out, _ = cli(capsys, "cp", inc, str(tmp_path / "alone"), "--json")
    assert rc == 0 and json.loads(out)["materialized"] == ["step-000000000001"]
    index = load_index(open_backend(str(tmp_path / "alone")))
    assert all(f.base is None for f in index.files)
    for f in index.files:
        assert os.path.getsize(tmp_path / "alone" / f.path) == f.size
    # It stands alone: remove the whole run, then load the copy.
    for d in (base, inc):
        for name in os.listdir(d):
            os.unlink(os.path.join(d, name))
    flat = _flat(changed)
    back = _load(tmp_path / "alone", flat)
    for k, v in flat.items():
        assert torch.equal(back[k], v), k


def test_ls_and_gc_keep_what_they_must(capsys, tmp_path):
    root = tmp_path / "run"
    with CheckpointManager(str(root), lease_ttl=None, writer_options={"sync": False}) as mgr:
        for step in (1, 2, 3, 4):
            mgr.save(step, {"w": torch.full((4,), float(step))})
    crashed = root / "step-000000000000"  # a save that died before its index
    crashed.mkdir()
    (crashed / "data-dead-r00000-00.bin").write_bytes(b"x" * 10)

    rc, out, _ = cli(capsys, "ls", str(root), "--json")
    assert rc == 0
    listed = {i["step"]: i for i in json.loads(out)}
    assert sorted(listed) == [0, 1, 2, 3, 4]
    assert not listed[0]["committed"] and all(listed[s]["committed"] for s in (1, 2, 3, 4))
    assert listed[4]["world_size"] == 1 and listed[4]["raw_nbytes"] == 16
    rc, out, _ = cli(capsys, "ls", str(root))
    assert "step-000000000000  partial" in out and "step-000000000004  committed" in out

    before = sorted(p for p, _, _ in os.walk(root))
    rc, out, _ = cli(capsys, "gc", str(root), "--keep-last", "2", "--json")
    plan = json.loads(out)
    assert rc == 0 and plan["dry_run"] and plan["removed_steps"] == ["step-000000000001", "step-000000000002"]
    assert "step-000000000000/data-dead-r00000-00.bin" in plan["paths"]
    assert not any(p.startswith(("step-000000000003", "step-000000000004")) for p in plan["paths"])
    assert sorted(p for p, _, _ in os.walk(root)) == before  # a dry run deletes nothing

    rc, out, _ = cli(capsys, "gc", str(root), "--keep-last", "2", "--yes")
    assert rc == 0 and "deleted 2 step(s)" in out
    rc, out, _ = cli(capsys, "ls", str(root), "--json")
    assert [(i["step"], i["committed"]) for i in json.loads(out)] == [(3, True), (4, True)]
    w = {"w": torch.zeros(4)}
    dcp.load(w, storage_reader=ShardReader(root / "step-000000000004"), no_dist=True)
    assert torch.equal(w["w"], torch.full((4,), 4.0))


# -- every verb on a missing path, a non-checkpoint and a partial checkpoint ---------------


def _bad_places(tmp_path) -> dict[str, str]:
    missing = tmp_path / "absent"
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("not a checkpoint")
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "data-0123456789ab-r00000-00.bin").write_bytes(b"\0" * 64)
    return {"missing": str(missing), "foreign": str(foreign), "partial": str(partial)}


def _bad_sources(tmp_path) -> dict[str, str]:
    """The same three cases for import (a safetensors source)."""
    good = tmp_path / "good.safetensors"
    save_file({"w": torch.ones(64)}, str(good))
    foreign = tmp_path / "foreign.safetensors"
    foreign.write_text("not a checkpoint")
    partial = tmp_path / "partial.safetensors"
    partial.write_bytes(good.read_bytes()[:-32])
    return {"missing": str(tmp_path / "absent.safetensors"), "foreign": str(foreign), "partial": str(partial)}


_EXPECTED = {
    "missing": "does not exist",
    "foreign": "not a|no checkpoints|holds no",
    "partial": "unfinished save|truncated",
}


@pytest.mark.parametrize("case", ["missing", "foreign", "partial"])
@pytest.mark.parametrize("verb", ["inspect", "export", "diff-a", "diff-b", "cp", "ls", "gc", "import"])
def test_every_verb_fails_with_one_clear_line(capsys, tmp_path, verb, case):
    good = _save(tmp_path / "good", {"w": torch.ones(3)})
    place = (_bad_sources(tmp_path) if verb == "import" else _bad_places(tmp_path))[case]
    argv = {
        "inspect": ["inspect", place],
        "export": ["export", place, str(tmp_path / "out.safetensors")],
        "diff-a": ["diff", place, good],
        "diff-b": ["diff", good, place],
        "cp": ["cp", place, str(tmp_path / "dst")],
        "ls": ["ls", place],
        "gc": ["gc", place],
        "import": ["import", place, str(tmp_path / "dst")],
    }[verb]
    rc, out, err = cli(capsys, *argv, "--json")
    lines = err.splitlines()
    assert rc != 0 and out == ""
    assert len(lines) == 1 and lines[0].startswith(f"shardstore {argv[0]}: error: "), err
    assert os.path.basename(place) in lines[0]
    if case == "missing":
        assert "does not exist" in lines[0] or "no safetensors file or directory" in lines[0], lines[0]
    else:
        assert re.search(_EXPECTED[case], lines[0]), lines[0]
    assert not os.path.exists(tmp_path / "dst") and not os.path.exists(tmp_path / "out.safetensors")
