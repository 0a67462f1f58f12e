"""shardstore: fast, safe distributed checkpoints on torch.distributed.checkpoint (DCP).

Public surface::

    dcp.save(state_dict, storage_writer=ShardWriter(path))
    dcp.load(state_dict, storage_reader=ShardReader(path))
    dcp.async_save(state_dict, storage_writer=ShardWriter(path))

    mgr = CheckpointManager("s3://bucket/run", keep_last=3)
    mgr.save(step, {"app": app_state})
    step = mgr.restore({"app": app_state})
"""

from __future__ import annotations

from shardstore.errors import (
    AsyncSaveInProgressError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    InvalidCheckpointError,
    LeaseError,
    LeaseHeldError,
    LeaseLostError,
    ShardstoreError,
    StateMismatchError,
    StorageError,
    TruncatedFileError,
    UnsupportedValueError,
    unwrap_error,
)
from shardstore.async_save import AsyncSaver, async_save
from shardstore.manager import CheckpointInfo, CheckpointManager, list_checkpoints
from shardstore.reader import ShardReader
from shardstore.stateful import PerRank, TrainState
from shardstore.writer import ShardWriter

__all__ = [
    "ShardWriter",
    "ShardReader",
    "CheckpointManager",
    "CheckpointInfo",
    "list_checkpoints",
    "TrainState",
    "PerRank",
    "async_save",
    "AsyncSaver",
    "ShardstoreError",
    "CheckpointNotFoundError",
    "CheckpointExistsError",
    "InvalidCheckpointError",
    "CorruptCheckpointError",
    "TruncatedFileError",
    "UnsupportedValueError",
    "StateMismatchError",
    "StorageError",
    "unwrap_error",
    "AsyncSaveInProgressError",
    "LeaseError",
    "LeaseHeldError",
    "LeaseLostError",
]
__version__ = "0.1.0"
