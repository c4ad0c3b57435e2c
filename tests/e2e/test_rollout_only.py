"""`miles rollout-only` end to end: Ray, the engine actor, rewards, and the files it writes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miles.io.metrics import read_metrics
from miles.io.rollout_file import load_rollout
from miles_cli.main import main

pytestmark = pytest.mark.slow


def test_rollout_only_writes_rollouts_grids_and_metrics(tiny_sd3_dir: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "run"
    rc = main(
        [
            "rollout-only",
            "--recipe",
            "tiny-digits-grpo",
            "--num-rollout",
            "2",
            "--rollout-batch-size",
            "2",
            "--n-samples-per-prompt",
            "4",
            "--global-batch-size",
            "8",
            "--output-dir",
            str(out),
            "--save-debug-rollout-data",
            str(tmp_path / "debug" / "r{rollout_id}.pt"),
        ]
    )
    assert rc == 0
    for rollout_id in (0, 1):
        rid, samples, _ = load_rollout(out / f"rollout_{rollout_id}.pt")
        assert rid == rollout_id and len(samples) == 8
        assert all(isinstance(s.trajectory.log_probs, torch.Tensor) for s in samples)
        assert (out / "images" / f"rollout_{rollout_id}.png").stat().st_size > 1000
        assert (tmp_path / "debug" / f"r{rollout_id}.pt").is_file()
        raw = torch.load(out / f"rollout_{rollout_id}.pt", weights_only=True)
        assert raw["rollout_id"] == rollout_id
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["rollout_id"] for r in rows] == [0, 1]
    for row in rows:
        assert 0.0 <= row["rollout/reward/raw_mean"] <= 1.0
        assert row["rollout/reward/raw_std"] >= 0.0
        assert row["perf/rollout_time"] > 0
    assert (out / "config.yaml").is_file()
