"""Replay: the rollout file exists, holds samples, and was made with the job's family and shapes."""

from __future__ import annotations

from pathlib import Path

import pytest
from preflight_helpers import Job, make_pipeline

from miles.preflight import find_problems
from miles.preflight.replay import check_rollout_files


@pytest.fixture(scope="module")
def rollout_io():
    from miles.core.sample import Sample
    from miles.io import rollout_file

    return rollout_file, Sample


GROUP = 16  # --n-samples-per-prompt of tiny-digits-grpo


def _trajectory(latent: tuple[int, ...] = (4, 8, 8), steps: int = 2):
    import torch

    from miles.core.sample import Trajectory

    return Trajectory(
        latents=torch.zeros(steps + 1, *latent), timesteps=torch.ones(steps), sigmas=torch.ones(steps + 1)
    )


def _samples(sample_cls, n: int = GROUP, latent: tuple[int, ...] = (4, 8, 8)) -> list:
    """`n` trainable samples: a trajectory of `latent`-shaped latents, a reward and an advantage each."""
    return [
        sample_cls(
            index=i,
            group_index=i // GROUP,
            prompt=f"the digit {i % 10}",
            reward=0.5,
            advantage=0.0,
            trajectory=_trajectory(latent),
        )
        for i in range(n)
    ]


def test_a_missing_rollout_file(job: Job, tmp_path: Path, rollout_io) -> None:
    missing = tmp_path / "rollout_0.pt"
    assert find_problems(job("replay", replay=str(missing))) == [f"ROLLOUT.pt rollout file not found: {missing}"]


def test_a_zero_sample_rollout_is_refused(job: Job, tmp_path: Path, rollout_io) -> None:
    rollout_file, _ = rollout_io
    path = rollout_file.save_rollout(tmp_path / "rollout_0.pt", 0, [])
    assert find_problems(job("replay", replay=str(path))) == [
        f"ROLLOUT.pt {path}: rollout 0 holds no samples, so there is nothing to train on; replay a rollout that "
        "has samples"
    ]


def test_user_data_in_a_broken_rollout_is_quoted_clipped(job: Job, tmp_path: Path) -> None:
    """A rollout file's own values reach the message clipped, never whole (a 100k-character key or id)."""
    import torch

    huge_key, huge_id = tmp_path / "huge_key.pt", tmp_path / "huge_id.pt"
    torch.save({"rollout_id": 0, "samples": [{"k" * 100_000: 1}]}, huge_key)
    torch.save({"rollout_id": "r" * 100_000, "samples": []}, huge_id)
    (key_problem,) = find_problems(job("replay", replay=str(huge_key)))
    assert key_problem.startswith(f"ROLLOUT.pt {huge_key}: samples[0] is not a sample (")
    assert key_problem.endswith("(100,055 chars))") and len(key_problem) < 400
    (id_problem,) = find_problems(job("replay", replay=str(huge_id)))
    assert id_problem == (
        f"ROLLOUT.pt {huge_id}: 'rollout_id' must be an int or a short name, got {'r' * 60!r}... (100,000 chars)"
    )


def test_a_rollout_of_another_family_is_refused(job: Job, tmp_path: Path, rollout_io) -> None:
    rollout_file, sample_cls = rollout_io
    made_with = {"family": "flux", "checkpoint": "tiny-flux", "denoiser": {"transformer": {"in_channels": 64}}}
    path = rollout_file.save_rollout(tmp_path / "r.pt", 0, _samples(sample_cls), model=made_with)
    (line,) = check_rollout_files(job("replay", replay=str(path), hf_checkpoint="tiny-sd3"))
    assert line.startswith(
        f"ROLLOUT.pt {path}: made with family flux, checkpoint tiny-flux, transformer in_channels 64, but the "
        "job's --hf-checkpoint is family sd3, checkpoint tiny-sd3"
    )
    # tiny-sd3 may be built in this session's MILES_HOME (its shapes are then compared too) or not
    assert "(family flux vs sd3" in line
    assert line.endswith(
        "; replay it on the checkpoint it was made with, or make a new rollout with this one (`miles rollout-only`)"
    )


def test_a_rollout_of_other_shapes_is_refused_and_a_matching_one_passes(job: Job, tmp_path: Path, rollout_io) -> None:
    from miles.models.model_record import model_record

    rollout_file, sample_cls = rollout_io
    checkpoint = make_pipeline(tmp_path / "my-sd3")  # transformer: in_channels 4, sample_size 8
    record = model_record(str(checkpoint))
    assert record == {
        "family": "sd3",
        "checkpoint": str(checkpoint),
        "denoiser": {"transformer": {"in_channels": 4, "sample_size": 8}},
    }
    same = rollout_file.save_rollout(tmp_path / "same.pt", 0, _samples(sample_cls), model=record)
    assert check_rollout_files(job("replay", replay=str(same), hf_checkpoint=str(checkpoint))) == []
    bigger = {**record, "denoiser": {"transformer": {"in_channels": 4, "sample_size": 16}}}
    other = rollout_file.save_rollout(tmp_path / "other.pt", 0, _samples(sample_cls), model=bigger)
    (line,) = check_rollout_files(job("replay", replay=str(other), hf_checkpoint=str(checkpoint)))
    assert "(transformer.sample_size 16 vs 8)" in line


def test_an_old_rollout_without_a_record_is_not_compared(job: Job, tmp_path: Path, rollout_io) -> None:
    rollout_file, sample_cls = rollout_io
    path = rollout_file.save_rollout(tmp_path / "old.pt", 0, _samples(sample_cls))
    _, _, extra = rollout_file.load_rollout(path)
    assert rollout_file.rollout_model(extra) is None
    assert check_rollout_files(job("replay", replay=str(path), hf_checkpoint="tiny-flux")) == []


def test_train_rl_on_saved_rollouts_names_the_missing_ones(job: Job, tmp_path: Path, rollout_io) -> None:
    rollout_file, sample_cls = rollout_io
    rollout_file.save_rollout(tmp_path / "r0.pt", 0, _samples(sample_cls))
    template = str(tmp_path / "r{rollout_id}.pt")
    resolved = job("rl", load_debug_rollout_data=template, num_rollout="3")
    assert check_rollout_files(resolved) == [
        f"--load-debug-rollout-data {template}: 2 of the 3 rollout files the run reads are missing (rollout ids 1, "
        f"2; first: {tmp_path / 'r1.pt'}); save them with `--save-debug-rollout-data` (or `miles rollout-only`), "
        "or lower --num-rollout"
    ]


# ---- damaged samples, incomplete groups, latents of another shape -------------------------------------------------
def test_non_finite_rewards_and_advantages_are_refused(job: Job, tmp_path: Path, rollout_io) -> None:
    rollout_file, sample_cls = rollout_io
    samples = _samples(sample_cls)
    samples[2].reward, samples[5].reward = float("nan"), {"score": float("inf")}
    samples[3].advantage = float("-inf")
    samples[7].reward, samples[7].remove_sample = float("nan"), True  # not trained on: not refused
    path = rollout_file.save_rollout(tmp_path / "r.pt", 0, samples)
    assert check_rollout_files(job("replay", replay=str(path))) == [
        f"ROLLOUT.pt {path}: samples[2] has a non-finite reward (nan) (and 1 more sample); replay a rollout whose "
        "rewards are finite numbers, or mark those samples remove_sample",
        f"ROLLOUT.pt {path}: samples[3] has a non-finite advantage (-inf); replay a rollout whose advantages were "
        "computed from finite rewards",
    ]


def test_a_reward_that_is_not_a_number_and_a_missing_advantage(job: Job, tmp_path: Path, rollout_io) -> None:
    rollout_file, sample_cls = rollout_io
    samples = _samples(sample_cls)
    samples[0].reward, samples[1].advantage = "high", None
    path = rollout_file.save_rollout(tmp_path / "r.pt", 0, samples)
    assert check_rollout_files(job("replay", replay=str(path))) == [
        f"ROLLOUT.pt {path}: samples[0] has reward 'high', not a number; replay a rollout whose rewards are finite "
        "numbers, or mark those samples remove_sample",
        f"ROLLOUT.pt {path}: samples[1] has no advantage; replay a rollout whose advantages were computed from "
        "finite rewards",
    ]


def test_a_sample_without_a_trajectory_is_refused(job: Job, tmp_path: Path, rollout_io) -> None:
    rollout_file, sample_cls = rollout_io
    samples = _samples(sample_cls)
    samples[4].trajectory = None
    path = rollout_file.save_rollout(tmp_path / "r.pt", 0, samples)
    assert check_rollout_files(job("replay", replay=str(path))) == [
        f"ROLLOUT.pt {path}: samples[4] has no trajectory (the latents it was denoised through), so it cannot be "
        "trained on; replay a rollout saved with its trajectories (`miles rollout-only`, --save-debug-rollout-data)"
    ]


def test_a_rollout_of_incomplete_groups_names_both_numbers(job: Job, tmp_path: Path, rollout_io) -> None:
    rollout_file, sample_cls = rollout_io
    path = rollout_file.save_rollout(tmp_path / "r.pt", 0, _samples(sample_cls, n=GROUP + 3))
    assert check_rollout_files(job("replay", replay=str(path))) == [
        f"ROLLOUT.pt {path}: {GROUP + 3} samples, not a multiple of --n-samples-per-prompt {GROUP} (a rollout holds "
        "whole prompt groups); replay a whole rollout, or give the --n-samples-per-prompt it was made with"
    ]


def _sd3_checkpoint(folder: Path) -> Path:
    import json

    checkpoint = make_pipeline(folder)  # transformer: in_channels 4, sample_size 8
    (checkpoint / "vae" / "config.json").write_text(json.dumps({"block_out_channels": [8, 8, 8, 8]}))  # scale 8
    return checkpoint


def test_latents_of_a_file_without_a_record_are_compared_with_the_checkpoint(
    job: Job, tmp_path: Path, rollout_io
) -> None:
    rollout_file, sample_cls = rollout_io
    checkpoint = _sd3_checkpoint(tmp_path / "my-sd3")
    flags = {"hf_checkpoint": str(checkpoint), "diffusion_height": "64", "diffusion_width": "64"}
    same = rollout_file.save_rollout(tmp_path / "same.pt", 0, _samples(sample_cls, latent=(4, 8, 8)))
    assert check_rollout_files(job("replay", replay=str(same), **flags)) == []
    narrow = rollout_file.save_rollout(tmp_path / "narrow.pt", 0, _samples(sample_cls, latent=(4, 8, 4)))
    assert check_rollout_files(job("replay", replay=str(narrow), **flags)) == [
        f"ROLLOUT.pt {narrow}: samples[0]'s latents are 4x8x4 (channels x height x width), but the job's "
        f"--hf-checkpoint {checkpoint} (transformer in_channels 4) at --diffusion-height 64 --diffusion-width 64 "
        "makes 4x8x8; the file records no model: replay it with the checkpoint and size it was made with"
    ]
    (checkpoint / "vae" / "config.json").write_text("{}")  # no scale factor: the channels alone
    wide = rollout_file.save_rollout(tmp_path / "wide.pt", 0, _samples(sample_cls, latent=(16, 8, 8)))
    assert check_rollout_files(job("replay", replay=str(wide), **flags)) == [
        f"ROLLOUT.pt {wide}: samples[0]'s latents have 16 channels, but the job's --hf-checkpoint {checkpoint} "
        "takes 4 (the transformer's in_channels); the file records no model: replay it on the checkpoint it was made "
        "with"
    ]
