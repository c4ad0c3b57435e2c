"""`miles export`'s refusals, one line each and before a model is built: no folder, no checkpoint in it, no config
to say what it trains, a DMD2 critic's folder, a config of a job that does not train."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles_cli.main import main


def _checkpoint(root: Path) -> Path:
    from miles.training.checkpoint import save_checkpoint

    save_checkpoint(root, 3, {"model.pt": {}}, {"extra.json": {"rollout_id": 3}})
    return root


def _config(where: Path, job: str, recipe: str, **cli: object) -> None:
    """The config.yaml a job with these flags writes beside its checkpoints."""
    from miles.config.export import to_yaml_text
    from miles.config.resolve import resolve

    (where / "config.yaml").write_text(to_yaml_text(resolve(job, cli=cli, recipe=recipe).args))


def _refused(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("miles: error: "), captured.err
    return lines[0]


def test_no_such_folder(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    line = _refused(["export", str(tmp_path / "nope")], capsys)
    assert "no such checkpoint directory" in line


def test_a_folder_without_checkpoints(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    line = _refused(["export", str(tmp_path)], capsys)
    assert str(tmp_path) in line and "checkpoint" in line


def test_a_step_that_is_not_there(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    ckpt = _checkpoint(tmp_path / "ckpt")
    line = _refused(["export", str(ckpt), "--ckpt-step", "7"], capsys)
    assert "--ckpt-step 7" in line and "available steps: 3" in line and "--load" not in line


def test_no_config_names_the_way_out(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    ckpt = _checkpoint(tmp_path / "ckpt")
    line = _refused(["export", str(ckpt)], capsys)
    assert "no config.yaml" in line and "--config" in line


def test_the_config_beside_the_folder_is_found_and_a_dmd2_critic_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    ckpt = _checkpoint(tmp_path / "ckpt" / "critic")
    _config(tmp_path / "ckpt", "dmd2", "tiny-digits-4step")
    line = _refused(["export", str(ckpt)], capsys)
    assert "the DMD2 critic" in line and str(tmp_path / "ckpt") in line


def test_a_config_of_a_job_that_does_not_train(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    ckpt = _checkpoint(tmp_path / "ckpt")
    _config(ckpt, "eval", "tiny-digits-grpo")
    line = _refused(["export", str(ckpt)], capsys)
    assert "an export needs a training job's" in line


def test_a_base_model_that_is_not_here(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    ckpt = _checkpoint(tmp_path / "ckpt")
    _config(ckpt, "sft", "tiny-digits-sft", hf_checkpoint=str(tmp_path / "stable-diffusion-3.5-medium"))
    line = _refused(["export", str(ckpt)], capsys)
    assert "the base model is not on this machine" in line and "--hf-checkpoint" in line


def test_options_that_mean_nothing_for_this_checkpoint_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    ckpt = _checkpoint(tmp_path / "ckpt")
    base = tmp_path / "stable-diffusion-3.5-medium"
    base.mkdir()  # here, so the refusals below are the options', before any model is built
    _config(ckpt, "sft", "tiny-digits-sft", hf_checkpoint=str(base))  # a full fine-tune
    line = _refused(["export", str(ckpt), "--merged"], capsys)
    assert "--merged" in line and "merged pipeline already" in line
    line = _refused(["export", str(ckpt), "--comfyui"], capsys)
    assert "--comfyui writes a LoRA file" in line
    line = _refused(["export", str(ckpt), "--weights", "best"], capsys)
    assert "--weights best: expected live or ema" in line
