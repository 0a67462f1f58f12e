"""State shared by the tests: a small model whose rows shard unevenly, and a deep state compare.

Rank functions run in spawned workers that import the test modules by name, so these live in a
plain module next to them (``tests/`` is on ``sys.path`` in the workers too).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class Net(nn.Module):
    """Small model with an embedding whose 10 rows do not divide evenly among 3 or 4 ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 12)
        self.l1 = nn.Linear(12, 24)
        self.l2 = nn.Linear(24, 12, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.relu(self.l1(self.emb(x)))).sum()


def assert_same_state(a: Any, b: Any, where: str = "") -> None:
    """Assert two (nested) state dicts are equal: same keys, tensors equal in dtype, shape and value."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{where}: {type(b).__name__} is not a tensor"
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
        assert torch.equal(a, b), f"tensor differs at {where}"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"keys differ at {where}: {set(a) ^ set(b or {})}"
        for k in a:
            assert_same_state(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_state(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"
