"""`miles rollout-only` end to end: Ray, the engine actor, rewards, and the files it writes."""

from __future__ import annotations

import pytest
import torch

from miles.io.metrics import read_metrics
from miles.io.rollout_file import load_rollout

pytestmark = pytest.mark.slow


def test_rollout_only_writes_rollouts_grids_and_metrics(diffusers_rollouts) -> None:
    out = diffusers_rollouts.out  # `miles rollout-only`, 2 rollouts of 2 prompts x 4 samples (tests/conftest.py)
    for rollout_id in (0, 1):
        rid, samples, _ = load_rollout(out / f"rollout_{rollout_id}.pt")
        assert rid == rollout_id and len(samples) == 8
        assert all(isinstance(s.trajectory.log_probs, torch.Tensor) for s in samples)
        assert all(s.trajectory.log_probs.shape == (3,) for s in samples)  # --diffusion-num-sde-steps 3
        assert (out / "images" / f"rollout_{rollout_id}.png").stat().st_size > 1000
        assert (diffusers_rollouts.debug / f"r{rollout_id}.pt").is_file()
        raw = torch.load(out / f"rollout_{rollout_id}.pt", weights_only=True)
        assert raw["rollout_id"] == rollout_id
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["rollout_id"] for r in rows] == [0, 1]
    for row in rows:
        assert 0.0 <= row["rollout/reward/raw_mean"] <= 1.0
        assert row["rollout/reward/raw_std"] >= 0.0
        assert row["perf/rollout_time"] > 0
        assert not any(k.startswith(("train/", "eval/")) for k in row)  # trains nothing, so evaluates nothing
    assert (out / "config.yaml").is_file()
