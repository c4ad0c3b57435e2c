"""`train rl`, `replay`, resume, `train sft` and `eval` end to end through the CLI (Ray, trainer groups)."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles.io.metrics import read_metrics
from miles_cli.main import main

pytestmark = pytest.mark.slow

SMALL = [
    "--rollout-batch-size",
    "2",
    "--n-samples-per-prompt",
    "4",
    "--rollout-microgroup-size",
    "4",
    "--global-batch-size",
    "4",
    "--micro-batch-size",
    "4",
    "--diffusion-num-steps",
    "6",
    "--diffusion-num-sde-steps",
    "2",
    "--diffusion-sde-window-range",
    "0,6",
]


def _rl(tiny_sd3_dir: Path, out: Path, *extra: str) -> list[dict]:
    argv = ["train", "rl", "--recipe", "tiny-digits-grpo", "--hf-checkpoint", str(tiny_sd3_dir)]
    rc = main([*argv, *SMALL, "--output-dir", str(out), *extra])
    assert rc == 0
    return read_metrics(out / "metrics.jsonl")


def test_train_rl_frozen_weights_recompute_matches_the_rollout(
    tiny_sd3_dir: Path, tmp_path: Path, small_digit_eval: list[str]
) -> None:
    """The alignment probe (--debug-skip-optimizer-step --diffusion-debug-mode) with --dump-details; then the
    dumped rollouts trained on with no engine (--train-only --load-debug-rollout-data). The eval set is evaluated
    after the last rollout (no --eval-interval), except where no engine runs."""
    dump = tmp_path / "dump"
    probe = ("--debug-skip-optimizer-step", "--diffusion-debug-mode", *small_digit_eval)
    *rows, final = _rl(tiny_sd3_dir, tmp_path / "frozen", "--num-rollout", "2", *probe, "--dump-details", str(dump))
    assert [r["rollout_id"] for r in rows] == [0, 1]
    assert final["rollout_id"] == 2 and final["eval/digits/num_samples"] == 10 and "train/loss" not in final
    for row in rows:
        assert row["train/log_prob_mean_abs_diff"] <= 1e-5
        assert row["train/model_output_mean_abs_diff"] == 0.0 and row["train/model_output_max_abs_diff"] == 0.0
        assert "perf/rollout_time" in row and "perf/train_time" in row
    assert (tmp_path / "frozen" / "curves.png").is_file()
    from miles.io.rollout_file import load_rollout

    for rid in (0, 1):
        _, samples, _ = load_rollout(dump / "rollout_data" / f"{rid}.pt")
        assert len(samples) == 8 and samples[0].trajectory.debug_model_outputs is not None
        _, _, extra = load_rollout(dump / "train_data" / f"{rid}.pt")
        assert extra["metrics"]["train/model_output_mean_abs_diff"] == 0.0
    replayed = _rl(
        tiny_sd3_dir,
        tmp_path / "train-only",
        "--num-rollout",
        "2",
        *probe,
        "--train-only",
        "--load-debug-rollout-data",
        str(dump / "rollout_data" / "{rollout_id}.pt"),
    )
    assert [r["rollout_id"] for r in replayed] == [0, 1]
    for row, original in zip(replayed, rows, strict=True):
        assert row["train/log_prob_mean_abs_diff"] == pytest.approx(original["train/log_prob_mean_abs_diff"], abs=1e-9)
        assert row["train/model_output_mean_abs_diff"] == 0.0 and "rollout/reward/raw_mean" not in row


# extended (~20 s, a job): `train rl --debug-rollout-only` hands the job to the rollout-only driver
# (miles/runtime/train_rl.py), the driver of `miles rollout-only`, whose run the default suite checks in
# tests/e2e/test_rollout_only.py::test_rollout_only_writes_rollouts_grids_and_metrics (rollout files, reward
# metrics, no train/ metric, no eval row); the flag the command forces: tests/config/test_rules.py::
# test_rollout_only_forces_debug_rollout_only
@pytest.mark.extended
def test_train_rl_debug_rollout_only_trains_and_evaluates_nothing(tiny_sd3_dir: Path, tmp_path: Path) -> None:
    only = _rl(tiny_sd3_dir, tmp_path / "rollout-only", "--num-rollout", "1", "--debug-rollout-only")
    assert len(only) == 1  # trains nothing, so evaluates nothing (the config rules warn that the eval set is unused)
    assert (tmp_path / "rollout-only" / "rollout_0.pt").is_file()
    assert "rollout/reward/raw_mean" in only[0] and not any(k.startswith("train/") for k in only[0])


# extended (~70 s): tests/training/test_trainer.py round-trips a checkpoint, and
# tests/e2e/test_sft_resume.py resumes a job through the same layout
@pytest.mark.extended
def test_resume_reproduces_an_uninterrupted_run(
    tiny_sd3_dir: Path, tmp_path: Path, small_digit_eval: list[str]
) -> None:
    common = ["--deterministic-mode", "--lr", "1e-3", "--num-rollout", "3", "--save-interval", "2", *small_digit_eval]

    def trained(rows: list[dict]) -> list[dict]:  # the rows of trained rollouts (the eval after the last is its own)
        return [row for row in rows if "train/loss" in row]

    straight = trained(_rl(tiny_sd3_dir, tmp_path / "straight", *common, "--save", str(tmp_path / "ck1")))
    first = trained(_rl(tiny_sd3_dir, tmp_path / "a", *common, "--save", str(tmp_path / "ck2"), "--num-rollout", "2"))
    assert [r["rollout_id"] for r in first] == [0, 1]
    resumed = _rl(
        tiny_sd3_dir, tmp_path / "b", *common, "--save", str(tmp_path / "ck2"), "--load", str(tmp_path / "ck2")
    )
    resumed = trained(resumed)
    assert [r["rollout_id"] for r in resumed] == [2]
    for a, b in zip(straight[2:], resumed, strict=True):
        for key in ("rollout/reward/raw_mean", "train/loss", "train/grad_norm", "train/log_prob_mean_abs_diff"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-9), key


def test_replay_trains_on_a_saved_rollout_without_engines(diffusers_rollouts, tmp_path: Path) -> None:
    replay_out = tmp_path / "replay"
    rollout = str(diffusers_rollouts.out / "rollout_0.pt")  # a `miles rollout-only` file (tests/conftest.py)
    rc = main(["replay", rollout, *diffusers_rollouts.flags, "--output-dir", str(replay_out)])
    assert rc == 0
    (row,) = read_metrics(replay_out / "metrics.jsonl")
    assert row["rollout_id"] == 0 and "train/loss" in row and row["replay/num_samples"] == 8
    assert row["train/log_prob_mean_abs_diff"] <= 1e-5  # the rollout's policy, recomputed by the trainer


def test_a_replay_that_fails_in_its_trainer_exits_1_with_the_line(
    diffusers_rollouts, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A rollout whose latents do not fit the model loads, then fails in the trainer: one line, exit 1 (the
    replay command once dropped its job's exit code and returned 0)."""
    import torch

    from miles.io.rollout_file import load_rollout, save_rollout

    rollout_id, samples, extra = load_rollout(diffusers_rollouts.out / "rollout_0.pt")
    for sample in samples:  # 5 latent channels for a 4-channel transformer
        lat = sample.trajectory.latents
        sample.trajectory.latents = torch.cat([lat, lat[:, :1]], dim=1)
    broken = tmp_path / "broken_0.pt"
    save_rollout(broken, rollout_id, samples, extra)
    capsys.readouterr()
    rc = main(["replay", str(broken), *diffusers_rollouts.flags, "--output-dir", str(tmp_path / "replay")])
    err = capsys.readouterr().err
    assert rc == 1, err
    errors = [line for line in err.splitlines() if line.startswith("miles: error:")]
    assert len(errors) == 1 and errors[0].startswith("miles: error: actor 0 on node"), err
    assert "Traceback" not in err


def test_train_sft_then_eval_of_its_checkpoint(
    tiny_sd3_dir: Path, tmp_path: Path, small_digit_eval: list[str]
) -> None:
    out = tmp_path / "sft"
    argv = ["train", "sft", "--recipe", "tiny-digits-sft", "--hf-checkpoint", str(tiny_sd3_dir), *small_digit_eval]
    assert main([*argv, "--num-rollout", "20", "--export-interval", "15", "--output-dir", str(out)]) == 0
    *rows, final = read_metrics(out / "metrics.jsonl")
    assert len(rows) == 20 and rows[-1]["train/loss"] < rows[0]["train/loss"]
    # the eval set after the last iteration, without --eval-interval (one in-process engine, the trained weights)
    assert final["rollout_id"] == 20 and final["eval/digits/num_samples"] == 10
    assert (out / "images" / "eval_digits_20.png").is_file()
    assert (out / "checkpoint" / "transformer").is_dir()
    # --export-interval 15: after iteration 15 and after the last (20), the merged pipeline (no LoRA)
    exports = out / "exports"
    assert sorted(p.name for p in exports.iterdir()) == ["iter_000015", "iter_000020", "latest.txt"]
    assert (exports / "latest.txt").read_text().strip() == "iter_000020"
    assert (exports / "iter_000015" / "pipeline" / "transformer").is_dir()
    ev = tmp_path / "eval"
    test_prompts = tmp_path / "few.jsonl"
    test_prompts.write_text(
        "".join(f'{{"input": "a handwritten digit {d}", "metadata": {{"label": {d}}}}}\n' for d in range(10))
    )
    head = ["eval", "--recipe", "tiny-digits-sft", "--hf-checkpoint", str(out / "checkpoint")]
    data = ["--eval-prompt-data", "few", str(test_prompts), "--n-samples-per-eval-prompt", "2"]
    rc = main([*head, *data, "--output-dir", str(ev)])
    assert rc == 0
    (row,) = read_metrics(ev / "metrics.jsonl")
    assert 0.0 <= row["eval/few/accuracy"] <= 1.0 and row["eval/few/num_samples"] == 20
    assert (ev / "images" / "eval_few.png").is_file()
