"""Ready-made state for :class:`~shardstore.manager.CheckpointManager`: what a training loop saves.

This module sits in front of the save/load flows: it turns a model, its optimizer(s), a learning
rate scheduler and plain counters into the state dict DCP's planners work on, and back. The
model and optimizer go through ``torch.distributed.checkpoint.state_dict.get_state_dict`` /
``set_state_dict``, which know FSDP2 (``fully_shard``, DTensor), FSDP1 (``SHARDED_STATE_DICT``,
ShardedTensor), TP and plain modules, and which key optimizer state by parameter name rather
than by position, so a checkpoint restores on any world size and parallelism.

:class:`PerRank` marks state whose value differs by rank (RNG state, a data loader's position).
Such state cannot follow a world-size change by itself, so the caller says what should happen
then: fail (the default), keep the live value, or take rank 0's value.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

__all__ = ["TrainState", "PerRank", "ON_RESIZE"]

#: What :class:`PerRank` state does on a restore under another world size.
ON_RESIZE = ("error", "drop", "rank0")

Scalar = int | float | str | bool | None


class TrainState:
    """Model + optimizer(s) (+ scheduler and plain counters) as one DCP ``Stateful``.

    Works for FSDP2 (``fully_shard``), FSDP1 (with ``SHARDED_STATE_DICT``, the default of
    ``get_state_dict``), TP/HSDP and unwrapped modules: the state is whatever
    ``get_state_dict(model, optimizer, options=options)`` returns (sharded DTensors /
    ShardedTensors, optimizer state keyed by parameter name), so DCP reshards it on load.

    Args:
        model: the (possibly FSDP-wrapped) module.
        optimizer: an optimizer, a sequence of them, or ``None`` (model only). Optimizer state
            that does not exist yet (no step taken) is created by ``get_state_dict`` so a
            fresh optimizer can be restored into.
        scheduler: anything with ``state_dict()``/``load_state_dict()`` (an LR scheduler),
            or ``None``.
        counters: plain values (step, epoch, tokens seen...) kept in :attr:`counters`; they
            are the same on every rank. They are saved as one value, so a restore replaces
            the dict's contents with the saved ones (keys the live dict lacks included).
        options: ``StateDictOptions`` for ``get_state_dict``/``set_state_dict`` (the default
            keeps the state sharded, which is what a distributed checkpoint wants).

    Example:
        >>> state = TrainState(model, opt, sched, counters={"step": 0})
        >>> mgr.save(step, {"train": state})
        >>> mgr.restore({"train": state}); step = state.counters["step"]
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] | None = None,
        scheduler: Stateful | None = None,
        *,
        counters: Mapping[str, Scalar] | None = None,
        options: StateDictOptions | None = None,
    ) -> None:
        self.model = model
        if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
            self.optimizers: tuple[torch.optim.Optimizer, ...] = () if optimizer is None else (optimizer,)
        else:
            self.optimizers = tuple(optimizer)
        self.scheduler = scheduler
        self.counters: dict[str, Scalar] = dict(counters or {})
        self.options = options

    def state_dict(self) -> dict[str, Any]:
        """The state to save: ``model``, ``optimizer``, ``scheduler``, ``counters``."""
        out: dict[str, Any] = {}
        if self.optimizers:
            out["model"], out["optimizer"] = get_state_dict(self.model, self.optimizers, options=self.options)
        else:
            out["model"] = get_model_state_dict(self.model, options=self.options)
        if self.scheduler is not None:
            out["scheduler"] = self.scheduler.state_dict()
        # A one-element tuple is a leaf for DCP: the whole dict is stored and loaded as one value,
        # so a restore brings back every saved counter, not only the keys the live dict has.
        out["counters"] = (dict(self.counters),)
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Apply a loaded state (as returned by :meth:`state_dict`, filled by DCP)."""
        if self.optimizers:
            set_state_dict(
                self.model,
                self.optimizers,
                model_state_dict=state_dict["model"],
                optim_state_dict=state_dict["optimizer"],
                options=self.options,
            )
        else:
            set_model_state_dict(self.model, state_dict["model"], options=self.options)
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state_dict["scheduler"])
        (counters,) = state_dict["counters"]
        self.counters.clear()
        self.counters.update(counters)


class PerRank:
    """Marks state whose value differs by rank (RNG state, a data loader's position).

    Each rank saves its own copy. A restore under the same world size gives every rank its own
    value back. Under another world size there is no right answer in general, so ``on_resize``
    says what to do:

    * ``"error"`` (default): :class:`~shardstore.errors.StateMismatchError` naming the state and
      both world sizes; nothing is loaded.
    * ``"drop"``: keep the live value (e.g. a freshly seeded RNG); the rest is restored.
    * ``"rank0"``: every rank gets rank 0's value.

    The policy of the wrapper passed to ``restore`` is the one applied. Values that are not
    wrapped are treated as the same on every rank (DCP stores one copy of a non-tensor value).

    Args:
        value: a DCP ``Stateful`` (restored in place via ``load_state_dict``) or a state dict
            (restored into :attr:`value`: nested dicts in place, top level replaced).
        on_resize: ``"error"``, ``"drop"`` or ``"rank0"``.

    Example:
        >>> rng = PerRank({"torch": torch.get_rng_state()}, on_resize="drop")
        >>> mgr.restore({"train": state, "rng": rng})
        >>> torch.set_rng_state(rng.value["torch"])
    """

    def __init__(
        self, value: Stateful | dict[str, Any], *, on_resize: Literal["error", "drop", "rank0"] = "error"
    ) -> None:
        if on_resize not in ON_RESIZE:
            raise ValueError(f"on_resize must be one of {ON_RESIZE}, got {on_resize!r}")
        if not isinstance(value, (dict, Stateful)):
            raise TypeError(f"PerRank wraps a state dict or a Stateful object, not {type(value).__name__}")
        self.value = value
        self.on_resize = on_resize

    def state_dict(self) -> dict[str, Any]:
        """The wrapped value's state dict (what one rank saves)."""
        return self.value if isinstance(self.value, dict) else self.value.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Apply one rank's loaded state to the wrapped value."""
        if isinstance(self.value, dict):
            self.value = state_dict
        else:
            self.value.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"PerRank({type(self.value).__name__}, on_resize={self.on_resize!r})"
