"""shardstore: fast, safe distributed checkpoints on torch.distributed.checkpoint (DCP).

Public surface::

    dcp.save(state_dict, storage_writer=ShardWriter(path))
    dcp.load(state_dict, storage_reader=ShardReader(path))
"""

from __future__ import annotations

from shardstore.errors import (
    AsyncSaveInProgressError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    InvalidCheckpointError,
    ShardstoreError,
    StateMismatchError,
    StorageError,
    TruncatedFileError,
    UnsupportedValueError,
    unwrap_error,
)
from shardstore.reader import ShardReader
from shardstore.writer import ShardWriter

__all__ = [
    "ShardWriter",
    "ShardReader",
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
]
__version__ = "0.1.0"
