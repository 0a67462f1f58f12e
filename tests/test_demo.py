"""The README's main job, `shardstore demo`, at a tiny size: save on 2 ranks, resume on 1."""

from __future__ import annotations

import os

from shardstore.demo import DemoConfig, run_demo


def test_demo_resumes_on_another_world_size_with_the_same_losses(tmp_path):
    lines: list[str] = []
    cfg = DemoConfig(ranks=2, resume_ranks=1, steps=5, save_every=2, crash_at=4, dim=32, layers=1,
                     heads=2, vocab=64, seq=8, batch=4, path=str(tmp_path / "ckpt"))
    assert run_demo(cfg, out=lines.append)
    text = "\n".join(lines)
    assert "resumed run matches the uninterrupted run exactly" in text
    assert "(DIFFERENT)" not in text and text.count("(same)") == 1  # step 5, after resuming from 4
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["step-000000000002", "step-000000000004"]
