"""The Qwen-Image-Edit-Plus family (qwen_image_edit on tiny-qwen-image-edit) through the jobs' CLI, on the embedded
digits edit task, as tests/e2e/test_edit_jobs.py runs flux_kontext: a live `train rl` of `tiny-qwen-image-edit-grpo`
(deterministic, its rollouts dumped) and the same training replayed from the dump with no engine give the same
metrics; `train sft` of `tiny-qwen-image-edit-sft` on edit rows, then `miles eval` of its checkpoint; a sample's
source reaches the reward (`digit_edit`).

`extended` (the tiny build and three jobs); the parts run in the default suite (the engine, the source's tokens and
the recompute in tests/models/test_qwen_image_edit.py, the recipes in tests/config).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from edit_job_helpers import sft_then_eval
from replay_helpers import LIVE_FLAGS, assert_train_metrics_agree, replay_flags

from miles.io.metrics import read_metrics
from miles_cli.main import main

pytestmark = [pytest.mark.slow, pytest.mark.extended]

# tests/e2e/test_edit_jobs.py's: 2 prompts x 4 samples, 6 steps (2 SDE steps), one optimizer step a rollout
SMALL = ["--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--rollout-microgroup-size", "4"]
SMALL += ["--global-batch-size", "4", "--micro-batch-size", "4", "--diffusion-num-steps", "6"]
SMALL += ["--diffusion-num-sde-steps", "2", "--diffusion-sde-window-range", "0,6", "--lr-warmup-iters", "0"]


@pytest.fixture(scope="module")
def tiny_qwen_image_edit_dir(miles_session_home: Path) -> Path:
    """tiny-qwen-image-edit with a 5-step VAE fit (the build tests/models/test_qwen_image_edit.py makes, shared on
    disk)."""
    from miles.builtin.tiny.qwen_image_edit import build_tiny_qwen_image_edit
    from miles.models.tiny.metadata import current_design

    name = f"tiny-qwen-image-edit-design{current_design('tiny-qwen-image-edit')}-vae5"
    path = miles_session_home / "test-builds" / name
    if not (path / "model_index.json").is_file():
        build_tiny_qwen_image_edit(path, progress=False, vae_steps=5)
    return path


def _rl(checkpoint: Path, rows: dict[str, Path], out: Path, *extra: str) -> list[dict]:
    argv = ["train", "rl", "--recipe", "tiny-qwen-image-edit-grpo", "--hf-checkpoint", str(checkpoint)]
    flags = ["--prompt-data", str(rows["train"]), "--eval-prompt-data", "edit", str(rows["train"]), *SMALL]
    assert main([*argv, *flags, "--output-dir", str(out), *extra]) == 0
    return read_metrics(out / "metrics.jsonl")


def test_live_training_and_its_replay_agree(tiny_qwen_image_edit_dir: Path, edit_rows, tmp_path: Path) -> None:
    """Two deterministic rollouts trained live, their rollouts dumped (`--dump-details`); the same two trainings on
    the dumped rollouts (`--train-only --load-debug-rollout-data`, no engine) give the same `train/*` metrics, the
    second on the weights the first trained."""
    dump = tmp_path / "dump"
    *live, final = _rl(
        tiny_qwen_image_edit_dir, edit_rows, tmp_path / "live", *LIVE_FLAGS, "--dump-details", str(dump)
    )
    assert [r["rollout_id"] for r in live] == [0, 1]
    assert final["eval/edit/num_samples"] == 4 and 0.0 <= final["eval/edit/reward_mean"] <= 1.0
    for row in live:
        assert 0.0 <= row["rollout/reward/raw_mean"] <= 1.0  # digit_edit read each sample's source
        # the random model's digit_edit rewards are tiny (~1e-6 to 1e-2), their group-normalised advantages are not
        assert row["train/grad_norm"] > 0.0 and row["train/log_prob_abs_diff_first_step"] <= 1e-5
    from miles.io.rollout_file import load_rollout

    _, samples, _ = load_rollout(dump / "rollout_data" / "0.pt")
    assert all(s.sources is not None and s.sources[0].shape == (3, 64, 64) for s in samples)
    assert all(s.conditions.positive["ref_tokens"].shape == (16, 16) for s in samples)  # the source's packed tokens
    assert all(s.trajectory.latents.shape[1:] == (4, 8, 8) for s in samples)  # the generated latents only

    replay = replay_flags(str(dump / "rollout_data" / "{rollout_id}.pt"))
    assert_train_metrics_agree(
        _rl(tiny_qwen_image_edit_dir, edit_rows, tmp_path / "train-only", *LIVE_FLAGS, *replay), live
    )


def test_sft_on_edit_rows_then_eval(tiny_qwen_image_edit_dir: Path, edit_rows, tmp_path: Path) -> None:
    row = sft_then_eval(
        tiny_qwen_image_edit_dir, edit_rows, "tiny-qwen-image-edit-sft", "tiny-qwen-image-edit-grpo", tmp_path
    )
    assert row["eval/edit/num_samples"] == 4 and 0.0 <= row["eval/edit/reward_mean"] <= 1.0
