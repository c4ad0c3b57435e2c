"""The live-vs-replay check every conditioned family's job tests share (tests/e2e/test_edit_jobs.py,
test_qwen_edit_jobs.py, test_i2v_jobs.py, test_ti2v_jobs.py): two deterministic rollouts trained live with their
rollouts dumped, then the same two trainings from the dump with no engine, must log the same `train/*` metrics."""

from __future__ import annotations

import pytest

# two rollouts, bit-reproducible, with a learning rate that moves the weights between them
LIVE_FLAGS = ("--num-rollout", "2", "--deterministic-mode", "--lr", "1e-3")


def replay_flags(dump: str) -> list[str]:
    """Train on the dumped rollouts (`{rollout_id}` in `dump`) with no engine."""
    return ["--train-only", "--load-debug-rollout-data", dump]


def assert_train_metrics_agree(replayed: list[dict], live: list[dict]) -> None:
    """The replayed job's training rows carry the same `train/*` keys as the live job's, each equal to 1e-6; the
    second row compares training on the weights the first one trained."""
    replayed = [r for r in replayed if "train/loss" in r]
    live = [r for r in live if "train/loss" in r]
    assert [r["rollout_id"] for r in replayed] == [r["rollout_id"] for r in live] == [0, 1]
    for row, original in zip(replayed, live, strict=True):
        trained = sorted(k for k in original if k.startswith("train/"))
        assert "train/grad_norm" in trained and sorted(k for k in row if k.startswith("train/")) == trained
        for key in trained:
            assert row[key] == pytest.approx(original[key], rel=1e-6, abs=1e-9), key
