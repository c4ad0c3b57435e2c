"""`--loss-type dpo` end to end through the CLI (Ray, trainer groups, files): online `train rl` on tiny-flux (a family
beyond sd3, ODE rollouts of whole groups, the frozen reference) and offline `train sft` on a digits preference set."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from miles.io.metrics import read_metrics
from miles_cli.main import main

pytestmark = pytest.mark.slow

# the tiny-digits-dpo recipe cut to 2 prompts x 4 samples (one optimizer window of both groups), 4 ODE steps
SMALL = ["--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--rollout-microgroup-size", "4"]
SMALL += ["--global-batch-size", "8", "--micro-batch-size", "4", "--diffusion-num-steps", "4"]
SMALL += ["--diffusion-dpo-num-timesteps", "2", "--lr", "1e-3"]
# tiny-flux-digits-grpo's guidance: FLUX's embedded guidance 3.5 and true CFG 4 for the rollout
FLUX = ["--diffusion-guidance-scale", "3.5", "--diffusion-true-cfg-scale", "4.0"]


def test_online_dpo_on_tiny_flux(tiny_flux_dir: Path, tmp_path: Path, small_digit_eval: list[str]) -> None:
    out = tmp_path / "dpo"
    argv = ["train", "rl", "--recipe", "tiny-digits-dpo", "--hf-checkpoint", str(tiny_flux_dir), *SMALL, *FLUX]
    assert main([*argv, *small_digit_eval, "--num-rollout", "2", "--output-dir", str(out)]) == 0
    *rows, final = read_metrics(out / "metrics.jsonl")
    assert [r["rollout_id"] for r in rows] == [0, 1]
    assert final["rollout_id"] == 2 and final["eval/digits/num_samples"] == 10  # the eval set after the last
    for row in rows:
        assert 0.0 <= row["rollout/reward/raw_mean"] <= 1.0
        assert row["train/pairs"] + row["train/tied_groups"] == 2  # one pair per group, or a tie
    first = rows[0]
    assert first["train/pairs"] >= 1
    # one optimizer step per rollout: rollout 0's loss is taken before any update, with policy == reference
    assert first["train/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert first["train/grad_norm"] > 0
    if rows[1]["train/pairs"]:
        assert math.isfinite(rows[1]["train/loss"]) and rows[1]["train/loss"] != pytest.approx(math.log(2), abs=1e-6)
    assert (out / "checkpoint" / "transformer").is_dir()
    config = (out / "config.yaml").read_text()
    assert "loss_type: dpo" in config and "ref_mode: frozen" in config


# extended (~60 s, a job): the job's preference rows (its encode_train_rows), the step from ln 2 and the moving
# policy are tests/training/test_dpo_trainer.py::test_offline_dpo_trains_a_step_on_the_digit_preference_set, the
# frozen reference ::test_online_dpo_trains_a_step_from_ln2_with_shared_noise_and_sigma, and the `train sft` job's
# loop, eval and export tests/e2e/test_train_jobs.py::test_train_sft_then_eval_of_its_checkpoint
@pytest.mark.extended
def test_offline_dpo_train_sft_on_a_preference_set(
    tiny_sd3_dir: Path, tmp_path: Path, small_digit_eval: list[str]
) -> None:
    from miles.data.digit_preferences import write_digit_preference_data

    files = write_digit_preference_data(tmp_path / "prefs", limit=16)
    out = tmp_path / "offline"
    argv = ["train", "sft", "--recipe", "tiny-digits-dpo-offline", "--hf-checkpoint", str(tiny_sd3_dir)]
    argv += ["--prompt-data", str(files["train"]), "--global-batch-size", "4", "--micro-batch-size", "4"]
    argv += ["--num-rollout", "3", "--lr", "1e-3", "--output-dir", str(out), *small_digit_eval]
    assert main(argv) == 0
    *rows, final = read_metrics(out / "metrics.jsonl")
    assert [r["rollout_id"] for r in rows] == [0, 1, 2]
    assert final["rollout_id"] == 3 and 0.0 <= final["eval/digits/accuracy"] <= 1.0  # after the last iteration
    assert rows[0]["train/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert all(r["train/pairs"] == 4 for r in rows)
    assert rows[-1]["train/loss"] != pytest.approx(math.log(2), abs=1e-6)
    assert (out / "checkpoint" / "transformer").is_dir()
