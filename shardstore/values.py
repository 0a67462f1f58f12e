"""Non-tensor values (step counters, scheduler state, RNG tuples) as msgpack: no pickle.

DCP hands a storage writer every non-tensor value as ``torch.save`` bytes and, on load, hands the
planner bytes that its default planner unpickles with ``weights_only=False``. shardstore never
stores those pickles: at save time the bytes are opened with ``torch.load(weights_only=True)``
(which cannot run code) and the value is re-encoded as msgpack; at load time the msgpack value is
decoded and re-serialised in-process before it reaches the planner. A checkpoint therefore never
carries bytes that could execute code on load, whichever planner loads it.

Supported: None, bool, int (64-bit), float, str, bytes, list, tuple, dict (str/int keys), and
small tensors nested inside such containers. Anything else raises ``UnsupportedValueError``
naming the key.
"""

from __future__ import annotations

import enum
import io
from typing import Any

import msgpack
import torch

from shardstore.errors import InvalidCheckpointError, UnsupportedValueError

_MAX_NESTED_TENSOR = 16 << 20


class ExtType(enum.IntEnum):
    """msgpack extension type ids used inside non-tensor values."""

    TUPLE = 1
    TENSOR = 2


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype called ``name`` (e.g. ``"bfloat16"``); a clear error for anything else."""
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise InvalidCheckpointError(f"unknown dtype {name!r} in checkpoint index")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """The name stored in the index for ``dtype``."""
    return _dtype_name(dtype)


def check_index_value(obj: Any, key: str) -> None:
    """Check a value that goes into the index itself (``user_metadata``), naming ``key``.

    The index is plain msgpack read back with string map keys only, so dict keys must be str and
    tensors are refused; a value the index cannot hold must fail the save, not every later load.
    """
    _check(obj, key, in_index=True)


def _check(obj: Any, key: str, *, in_index: bool = False) -> None:
    """Reject what msgpack would silently change or cannot hold, naming the key."""
    if obj is None or isinstance(obj, (bool, float, str, bytes)):
        return
    if isinstance(obj, int):
        if not -(1 << 63) <= obj < (1 << 64):
            raise UnsupportedValueError(f"value of {key!r} is an integer too large for 64 bits")
        return
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _check(v, f"{key}[{i}]", in_index=in_index)
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            if type(k) not in ((str,) if in_index else (str, int)):
                raise UnsupportedValueError(
                    f"value of {key!r} has a dict key of type {type(k).__name__}; only "
                    f"{'str keys' if in_index else 'str and int keys'} can be stored"
                )
            _check(v, f"{key}[{k!r}]", in_index=in_index)
        return
    if isinstance(obj, torch.Tensor) and not in_index:
        if obj.numel() * obj.element_size() > _MAX_NESTED_TENSOR:
            raise UnsupportedValueError(f"tensor nested in the value of {key!r} is too large; store it as a state_dict entry")
        return
    raise UnsupportedValueError(
        f"cannot store the value of {key!r} (type {type(obj).__module__}.{type(obj).__qualname__}) without pickle; "
        "store plain Python data (None, bool, int, float, str, bytes, list, tuple, dict) or tensors"
    )


def _default(obj: Any) -> msgpack.ExtType:
    if isinstance(obj, tuple):
        return msgpack.ExtType(ExtType.TUPLE, _pack(list(obj)))
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        payload = [_dtype_name(t.dtype), list(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes()]
        return msgpack.ExtType(ExtType.TENSOR, _pack(payload))
    raise TypeError(f"unexpected {type(obj)}")  # _check ran first; unreachable for valid input


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, default=_default, strict_types=True, use_bin_type=True)


def _ext_hook(code: int, data: bytes) -> Any:
    if code == ExtType.TUPLE:
        return tuple(unpack_value(data))
    if code == ExtType.TENSOR:
        dtype, shape, raw = unpack_value(data)
        t = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        return t.view(dtype_from_name(dtype)).reshape(shape)
    raise InvalidCheckpointError(f"unknown msgpack extension type {code} in a stored value")


def pack_value(obj: Any, key: str) -> bytes:
    """Encode one non-tensor value; ``UnsupportedValueError`` names ``key`` if it cannot be stored."""
    _check(obj, key)
    return _pack(obj)


def unpack_value(data: bytes) -> Any:
    """Decode a value written by :func:`pack_value`. Never executes code."""
    try:
        return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise InvalidCheckpointError(f"stored value is not valid msgpack: {e}") from e


def value_from_dcp_bytes(buf: io.BytesIO, key: str) -> bytes:
    """Turn the ``torch.save`` bytes DCP gives a writer into msgpack bytes."""
    buf.seek(0)
    try:
        obj = torch.load(buf, weights_only=True)
    except Exception as e:  # weights_only refuses arbitrary classes: that is the point
        raise UnsupportedValueError(
            f"cannot store the value of {key!r} without pickle: {str(e).splitlines()[0]}"
        ) from e
    return pack_value(obj, key)


def value_to_dcp_bytes(data: bytes) -> io.BytesIO:
    """Decode a stored value and serialise it for ``LoadPlanner.load_bytes``.

    The bytes handed on are produced here from plain decoded data, so even a planner that
    unpickles them with ``weights_only=False`` only rebuilds lists, dicts and numbers.
    """
    out = io.BytesIO()
    torch.save(unpack_value(data), out)
    out.seek(0)
    return out
