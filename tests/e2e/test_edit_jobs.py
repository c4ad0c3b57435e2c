"""The edit family (flux_kontext on tiny-flux-kontext) through the jobs' CLI, on the embedded digits edit task.

A live `train rl` (deterministic, its rollouts dumped) and the same training replayed from the dump with no engine
give the same metrics; the frozen-weights probe recomputes the rollout's log-probs and model outputs exactly, the
source tokens among the conditions; `train sft` on edit rows and `miles eval` run on the same model; a sample's
source reaches the reward (`digit_edit`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from edit_job_helpers import sft_then_eval
from replay_helpers import LIVE_FLAGS, assert_train_metrics_agree, replay_flags

from miles.io.metrics import read_metrics
from miles_cli.main import main

pytestmark = pytest.mark.slow

SMALL = ["--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--rollout-microgroup-size", "4"]
SMALL += ["--global-batch-size", "4", "--micro-batch-size", "4", "--diffusion-num-steps", "6"]
SMALL += ["--diffusion-num-sde-steps", "2", "--diffusion-sde-window-range", "0,6", "--lr-warmup-iters", "0"]


def _rl(checkpoint: Path, rows: dict[str, Path], out: Path, *extra: str) -> list[dict]:
    argv = ["train", "rl", "--recipe", "tiny-flux-kontext-edit-grpo", "--hf-checkpoint", str(checkpoint)]
    flags = ["--prompt-data", str(rows["train"]), "--eval-prompt-data", "edit", str(rows["train"]), *SMALL]
    assert main([*argv, *flags, "--output-dir", str(out), *extra]) == 0
    return read_metrics(out / "metrics.jsonl")


@pytest.mark.extended  # 67 s; the default run replays text-to-image rollouts (tests/e2e), recomputes Kontext exactly
def test_live_training_and_its_replay_agree(tiny_flux_kontext_dir: Path, edit_rows, tmp_path: Path) -> None:
    dump = tmp_path / "dump"
    *live, final = _rl(tiny_flux_kontext_dir, edit_rows, tmp_path / "live", *LIVE_FLAGS, "--dump-details", str(dump))
    assert [r["rollout_id"] for r in live] == [0, 1]
    assert final["eval/edit/num_samples"] == 4 and 0.0 <= final["eval/edit/reward_mean"] <= 1.0
    for row in live:
        assert 0.0 <= row["rollout/reward/raw_mean"] <= 1.0  # digit_edit read each sample's source
    from miles.io.rollout_file import load_rollout

    _, samples, _ = load_rollout(dump / "rollout_data" / "0.pt")
    assert all(s.sources is not None and s.sources[0].shape == (3, 64, 64) for s in samples)
    assert all(s.conditions.positive["ref_tokens"].shape == (16, 16) for s in samples)
    assert all(s.trajectory.latents.shape[1:] == (4, 8, 8) for s in samples)  # the generated latents only

    replay = replay_flags(str(dump / "rollout_data" / "{rollout_id}.pt"))
    assert_train_metrics_agree(
        _rl(tiny_flux_kontext_dir, edit_rows, tmp_path / "train-only", *LIVE_FLAGS, *replay), live
    )


@pytest.mark.extended  # 40 s; the recompute's exactness is tested per step in tests/models/test_flux_kontext.py
def test_frozen_weights_recompute_the_rollout_exactly(tiny_flux_kontext_dir: Path, edit_rows, tmp_path: Path) -> None:
    probe = ("--num-rollout", "1", "--debug-skip-optimizer-step", "--diffusion-debug-mode")
    rows = _rl(tiny_flux_kontext_dir, edit_rows, tmp_path / "frozen", *probe, "--diffusion-true-cfg-scale", "2.0")
    row = next(r for r in rows if "train/loss" in r)
    assert row["train/log_prob_mean_abs_diff"] <= 1e-6
    assert row["train/model_output_mean_abs_diff"] == 0.0 and row["train/model_output_max_abs_diff"] == 0.0


def test_sft_on_edit_rows_then_eval(tiny_flux_kontext_dir: Path, edit_rows, tmp_path: Path) -> None:
    row = sft_then_eval(
        tiny_flux_kontext_dir, edit_rows, "tiny-flux-kontext-edit-sft", "tiny-flux-kontext-edit-grpo", tmp_path
    )
    assert row["eval/edit/num_samples"] == 4 and 0.0 <= row["eval/edit/reward_mean"] <= 1.0
