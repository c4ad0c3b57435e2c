"""Replay: the rollout file exists, holds samples, and was made with the job's family and shapes."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import Job
from preflight_helpers import make_pipeline

from miles.preflight import find_problems
from miles.preflight.replay import check_rollout_files


@pytest.fixture(scope="module")
def rollout_io():
    from miles.io import rollout_file
    from miles.rollout.types import Sample

    return rollout_file, Sample


def _samples(sample_cls, n: int = 4) -> list:
    return [sample_cls(index=i, group_index=i // 2, prompt=f"the digit {i}", reward=0.5) for i in range(n)]


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
