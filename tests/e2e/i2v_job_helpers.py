"""Shared flags and job of the image-to-video jobs' tests (tests/e2e/test_i2v_jobs.py, test_ti2v_jobs.py): both
families run the digits-i2v task through the same CLI, each with its own tiny build and recipes."""

from __future__ import annotations

from pathlib import Path

from replay_helpers import LIVE_FLAGS, assert_train_metrics_agree, replay_flags

from miles.io.metrics import read_metrics
from miles_cli.main import main

# a GRPO rollout from an SFT's checkpoint: 2 prompts x 4 samples, 4 steps (2 SDE steps), one optimizer step
SMALL = ["--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--rollout-microgroup-size", "4"]
SMALL += ["--global-batch-size", "8", "--micro-batch-size", "8", "--diffusion-num-steps", "4"]
SMALL += ["--diffusion-num-sde-steps", "2", "--diffusion-sde-window-range", "0,4", "--lr-warmup-iters", "0"]

# the jobs on the tiny build itself (live training and its replay, eval, rollout-only): 2 prompts x 2 samples, 4
# steps (2 SDE steps), one optimizer step a rollout. The random tiny models' videos score digit_i2v ~1e-14
# (advantages of the eps alone), so clip_i on a tiny random CLIP (tests/conftest.py's) joins it: a second reward that
# reads each sample's first frame and spreads a group's rewards, so a replayed training has a real gradient to agree
# on. Each reward is then logged by name.
TINY = ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-microgroup-size", "2"]
TINY += ["--global-batch-size", "4", "--micro-batch-size", "4", "--diffusion-num-steps", "4"]
TINY += ["--diffusion-num-sde-steps", "2", "--diffusion-sde-window-range", "0,4", "--lr-warmup-iters", "0"]


def run_i2v_job(
    recipe: str,
    job: list[str],
    checkpoint: Path,
    rows: dict[str, Path],
    clip: tuple[str, str],
    out: Path,
    *extra: str,
) -> list[dict]:
    """`miles JOB --recipe RECIPE` on `checkpoint` with the TINY flags, digits-i2v rows (`i2v_rows`) and the
    digit_i2v + clip_i rewards; -> the job's metrics rows."""
    argv = [*job, "--recipe", recipe, "--hf-checkpoint", str(checkpoint)]
    flags = ["--prompt-data", str(rows["train"]), "--eval-prompt-data", "i2v", str(rows["test"]), *TINY]
    flags += [
        "--rm-type",
        "digit_i2v,clip_i",
        "--clip-score-model-path",
        clip[0],
        "--clip-score-processor-path",
        clip[1],
    ]
    assert main([*argv, *flags, "--output-dir", str(out), *extra]) == 0
    return read_metrics(out / "metrics.jsonl")


def live_then_replay(recipe: str, checkpoint: Path, rows: dict[str, Path], clip: tuple[str, str], tmp: Path) -> str:
    """Two deterministic rollouts of `recipe` trained live, their rollouts dumped (`--save-debug-rollout-data`),
    each row's rewards read from its samples' first frames and spread within a group; then the same two trainings
    on the dump (`--train-only --load-debug-rollout-data`, no engine) log the same `train/*` metrics. -> the dump's
    path template, for the family's own checks of what a rollout file carries."""
    dump = str(tmp / "dump" / "{rollout_id}.pt")
    model = (checkpoint, rows, clip)
    *live, final = run_i2v_job(
        recipe, ["train", "rl"], *model, tmp / "live", *LIVE_FLAGS, "--save-debug-rollout-data", dump
    )
    assert [r["rollout_id"] for r in live] == [0, 1]
    assert final["eval/i2v/num_samples"] == 2 and 0.0 <= final["eval/i2v/digit_i2v/reward_mean"] <= 1.0
    for row in live:
        assert 0.0 <= row["rollout/reward/digit_i2v/raw_mean"] <= 1.0  # each read its sample's first frame
        assert row["rollout/reward/clip_i/raw_std"] > 0.0  # the group's rewards differ: a real gradient
        assert row["train/grad_norm"] > 1e-6 and row["train/log_prob_mean_abs_diff"] <= 1e-5
    replayed = run_i2v_job(recipe, ["train", "rl"], *model, tmp / "train-only", *LIVE_FLAGS, *replay_flags(dump))
    assert_train_metrics_agree(replayed, live)  # no engine, so no eval row
    return dump
