"""Import: safetensors into FSDP2 state on 2 and 3 ranks, exact, each rank reading its share."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

from shardstore.testing import run_ranks
from shardstore import CheckpointNotFoundError, InvalidCheckpointError, ShardReader
from shardstore.importer import SafetensorsReader, import_safetensors, load_safetensors


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 30))


def _pretrained() -> dict[str, torch.Tensor]:
    torch.manual_seed(3)
    weights = {k: torch.randn_like(v) for k, v in _model().state_dict().items()}
    weights["cols"] = torch.randn(8, 4096)  # a column-sharded tensor: rows of 16 KiB
    return weights


def _load_fsdp2(path: str) -> dict:
    """Each rank loads the file into its FSDP2 shards; returns what it read and whether it matched."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(100 + dist.get_rank())  # different from the file everywhere
    model = _model()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sd = {"model": model.state_dict()}
    if world == 2:
        sd["cols"] = distribute_tensor(torch.zeros(8, 4096), mesh, [Shard(1)])
    reader = load_safetensors(sd, path)  # the file names tensors "model.<param>" and "cols", as DCP flattens sd
    expected = _pretrained()
    mismatched = []
    for name, param in model.state_dict().items():
        if not torch.equal(param.full_tensor(), expected[name]):
            mismatched.append(name)
    if world == 2 and not torch.equal(sd["cols"].full_tensor(), expected["cols"]):
        mismatched.append("cols")
    local = sum(p.to_local().numel() * p.element_size() for p in model.state_dict().values())
    if world == 2:
        local += sd["cols"].to_local().numel() * 4
    return {"bytes_read": reader.bytes_read, "local_bytes": local, "mismatched": mismatched}


@pytest.fixture(scope="module")
def pretrained_file(tmp_path_factory) -> tuple[str, int]:
    path = tmp_path_factory.mktemp("import") / "model.safetensors"
    weights = _pretrained()
    save_file({("cols" if k == "cols" else f"model.{k}"): v for k, v in weights.items()}, str(path))
    return str(path), sum(v.numel() * v.element_size() for v in weights.values())


@pytest.mark.parametrize("world", [2, 3])
def test_import_into_fsdp2_is_exact_and_each_rank_reads_its_share(pretrained_file, world):
    path, total = pretrained_file
    results = run_ranks(world, _load_fsdp2, path)
    for rank, r in enumerate(results):
        assert r["mismatched"] == [], f"rank {rank}"
        # A rank reads exactly the bytes of its own shards: rows of a Shard(0) parameter are one
        # range, a Shard(1) tensor one range per row (the gaps between rows are not read).
        assert r["bytes_read"] == r["local_bytes"], f"rank {rank}"
    if world == 2:
        assert sum(r["bytes_read"] for r in results) == total
    else:  # no "cols" tensor on 3 ranks
        assert sum(r["bytes_read"] for r in results) == total - 8 * 4096 * 4
    assert max(r["bytes_read"] for r in results) < 1.2 * total / world


def test_directory_of_files_casts_and_converts(tmp_path):
    torch.manual_seed(0)
    a = {"layers.0.w": torch.randn(5, 3), "layers.0.b": torch.randn(5)}
    b = {"layers.1.w": torch.randn(2, 5).to(torch.bfloat16), "steps": torch.arange(4, dtype=torch.int32)}
    save_file(a, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file(b, str(tmp_path / "model-00002-of-00002.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    save_file({"other": torch.ones(1)}, str(tmp_path / "consolidated.safetensors"))  # not in the index
    weight_map = {k: "model-00001-of-00002.safetensors" for k in a} | {k: "model-00002-of-00002.safetensors" for k in b}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    everything = {**a, **b}

    # Plain tensors, no process group; a float32 target for a bfloat16 tensor is cast on load.
    target = {k: torch.zeros(v.shape, dtype=torch.float32 if k == "layers.1.w" else v.dtype) for k, v in everything.items()}
    target = {"model": target}
    load_safetensors(target, tmp_path, add_prefix="model.")
    for k, v in everything.items():
        assert torch.equal(target["model"][k], v.to(target["model"][k].dtype)), k

    # Conversion to a shardstore checkpoint, read back through ShardReader.
    result = import_safetensors(tmp_path, tmp_path / "ckpt", sync=False, compression="zstd")
    assert result.tensors == 4 and result.bytes == sum(v.numel() * v.element_size() for v in everything.values())
    back = {k: torch.zeros_like(v) for k, v in everything.items()}
    dcp.load(back, storage_reader=ShardReader(tmp_path / "ckpt"), no_dist=True)
    for k, v in everything.items():
        assert torch.equal(back[k], v), k


def test_bad_sources_are_clear_errors(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="no safetensors file or directory at"):
        SafetensorsReader(tmp_path / "absent.safetensors")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointNotFoundError, match="no .safetensors files in"):
        SafetensorsReader(tmp_path / "empty")
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(InvalidCheckpointError, match="garbage.safetensors is not a safetensors file"):
        SafetensorsReader(garbage)
    good = tmp_path / "good.safetensors"
    save_file({"w": torch.ones(100)}, str(good))
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(good.read_bytes()[:-10])
    with pytest.raises(InvalidCheckpointError, match="cut.safetensors is truncated: tensor 'w'"):
        SafetensorsReader(cut)
    dup = tmp_path / "dup"
    dup.mkdir()
    save_file({"w": torch.ones(1)}, str(dup / "a.safetensors"))
    save_file({"w": torch.ones(1)}, str(dup / "b.safetensors"))
    with pytest.raises(InvalidCheckpointError, match="tensor 'w' is in both a.safetensors and b.safetensors"):
        SafetensorsReader(dup)
