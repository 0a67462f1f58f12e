"""Write results the index cannot hold are refused at save time, naming the rank or the key.

Malformed packed write results (``RankChunks``) must fail ``build_index`` with an error that
names the rank that sent them, a tensor name no chunk uses must not commit a tensor that loads
as "nothing to read", and ``user_metadata`` the index cannot hold must fail the save rather than
commit a checkpoint no reader can open. Write results come from a real single-process save
(recorded in ``finish``) and are replayed as several ranks, so the inputs are exactly what
``ShardWriter.write_data`` sends.
"""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any, Callable

import msgpack
import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.storage import WriteResult

from shardstore import ShardReader, ShardWriter
from shardstore.config import INDEX_NAME
from shardstore.errors import InvalidCheckpointError, ShardstoreError
from shardstore.index import RankChunks, build_index

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

FRAME = 4096


class _Recording(ShardWriter):
    """Keeps what DCP hands to ``finish``."""

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        self.metadata, self.results = metadata, pickle.loads(pickle.dumps(results))
        super().finish(metadata, results)


def _recorded(tmp_path_factory: pytest.TempPathFactory, state: dict[str, Any]) -> tuple[Metadata, list[WriteResult]]:
    writer = _Recording(str(tmp_path_factory.mktemp("rec") / "c"), threads=2, frame_size=FRAME)
    dcp.save(state, storage_writer=writer)
    (rank_results,) = writer.results
    return writer.metadata, rank_results


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Metadata, list[WriteResult]]:
    """Tensors of 2, 1 and 0 dimensions (build_index's per-ndim path) and a value."""
    state = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(5), "s": torch.tensor(2.0), "step": 3}
    return _recorded(tmp_path_factory, state)


@pytest.fixture(scope="module")
def same_ndim(tmp_path_factory: pytest.TempPathFactory) -> tuple[Metadata, list[WriteResult]]:
    """Only 2-D tensors (build_index's single-ndim path)."""
    return _recorded(tmp_path_factory, {"w": torch.arange(12.0).reshape(3, 4), "v": torch.ones(2, 2)})


def _as_ranks(recorded: tuple[Metadata, list[WriteResult]], bad: int, change: Callable[[RankChunks], dict]):
    """``recorded`` replayed as 3 ranks, rank ``bad``'s packed chunks changed by ``change``."""
    md, rank_results = recorded
    md = pickle.loads(pickle.dumps(md))
    results = [pickle.loads(pickle.dumps(rank_results)) for _ in range(3)]
    rc = next(wr.storage_data for wr in results[bad] if isinstance(wr.storage_data, RankChunks))
    results[bad] = [wr for wr in results[bad] if wr.storage_data is not rc] + [
        WriteResult(MetadataIndex("<rank>", index=bad), 0, dataclasses.replace(rc, **change(rc)))
    ]
    return md, results


def _negative_nframes(rc: RankChunks) -> dict:
    nframes = np.frombuffer(rc.nframes, dtype="<i4").copy()
    nframes[0] = -1
    return {"nframes": nframes.tobytes()}


@pytest.mark.parametrize(
    "change",
    [
        _negative_nframes,
        lambda rc: {"fqns": b"\xc1"},
        lambda rc: {"fqns": msgpack.packb([1, 2])},
        lambda rc: {"fqns": msgpack.packb(["nope", *rc.names()[1:]])},
    ],
    ids=["negative-frame-count", "names-garbage", "names-type", "unknown-tensor"],
)
def test_malformed_rank_chunks_error_names_the_rank(mixed, change):
    """Every other check of a RankChunks says which rank sent it; these four do not."""
    md, results = _as_ranks(mixed, 1, change)
    with pytest.raises(InvalidCheckpointError, match=r"\brank 1\b"):
        build_index(md, results, frame_size=FRAME)


@pytest.mark.parametrize("layout", ["mixed", "same_ndim"])
def test_a_tensor_name_no_chunk_uses_is_refused_naming_the_rank(layout, request):
    """A name in a rank's ``fqns`` table that none of its chunks refers to (the dual of an id
    outside the table, which is refused). With tensors of several ndims, build_index dies with
    a bare numpy IndexError; with one ndim it silently commits a tensor with no chunks, which a
    DCP load then skips without an error (the target keeps its old values)."""
    md, results = _as_ranks(request.getfixturevalue(layout), 1, lambda rc: {"fqns": msgpack.packb([*rc.names(), "ghost"])})
    md.state_dict_metadata["ghost"] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size((3, 3)), [])
    with pytest.raises(InvalidCheckpointError, match=r"rank 1.*'ghost'|'ghost'.*rank 1"):
        build_index(md, results, frame_size=FRAME)


def test_user_metadata_that_the_index_cannot_hold_never_commits_an_unreadable_checkpoint(tmp_path):
    """Pre-existing (not from d83d8d8): ``decode_index`` unpacks with ``strict_map_key=True``, but
    nothing checks ``user_metadata`` at save time, so a non-str key commits an index that every
    reader refuses as "not a shardstore index". Either the save refuses it, naming the option, or
    the checkpoint loads."""
    path = tmp_path / "c"
    user = {"lr_by_epoch": {0: 0.1, 1: 0.05}}
    try:
        dcp.save({"w": torch.ones(4)}, storage_writer=ShardWriter(str(path), user_metadata=user))
    except (ShardstoreError, CheckpointException) as e:  # DCP wraps a rank's error
        assert "user" in str(e) and "lr_by_epoch" in str(e), e
        assert not (path / INDEX_NAME).exists()
        return
    reader = ShardReader(str(path))
    out = {"w": torch.zeros(4)}
    dcp.load(out, storage_reader=reader)
    assert torch.equal(out["w"], torch.ones(4))
