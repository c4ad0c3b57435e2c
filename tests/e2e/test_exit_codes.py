"""The exit code is the outcome, for every job command: 0 done, 1 a runtime failure, 2 a usage mistake, 130/143
interrupted (docs/fault-tolerance.md).

Here every job command fails at runtime the same cheap way, its output directory on a full disk (a tmpfs of its
own; root, skipped otherwise), before Ray starts: exit 1 with one line naming the path, and a usage mistake
exits 2. Their successes (exit 0) are asserted where each job is tested end to end (tests/e2e/test_train_jobs.py,
test_family_jobs.py, test_dpo_jobs.py, tests/conftest.py's rollout-only run), interrupts in test_job_failures.py,
and a replay whose trainer fails (once exit 0) in test_train_jobs.py.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from miles_cli.main import main

pytestmark = pytest.mark.slow


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    where = tmp_path / "disk"
    where.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        fd = os.open(where / "filler", os.O_WRONLY | os.O_CREAT, 0o644)
        with contextlib.suppress(OSError):
            while os.write(fd, b"\0" * 4096):
                pass
        os.close(fd)
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def _commands(tiny_sd3_dir: Path, rollout: Path, rollout_flags: tuple[str, ...]) -> dict[str, list[str]]:
    ckpt = ["--hf-checkpoint", str(tiny_sd3_dir)]
    return {
        "train rl": ["train", "rl", "--recipe", "tiny-digits-grpo", *ckpt],
        "train sft": ["train", "sft", "--recipe", "tiny-digits-sft", *ckpt],
        "train dmd2": ["train", "dmd2", "--recipe", "tiny-digits-4step"],
        "eval": ["eval", "--recipe", "tiny-digits-grpo", *ckpt],
        "rollout-only": ["rollout-only", "--recipe", "tiny-digits-grpo", *ckpt],
        "replay": ["replay", str(rollout), *rollout_flags],  # the flags the rollout was made with
    }


def test_every_job_command_exits_1_on_a_runtime_failure_and_2_on_a_usage_mistake(
    tiny_sd3_dir: Path, diffusers_rollouts, full_disk: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rollout = diffusers_rollouts.out / "rollout_0.pt"
    for name, argv in _commands(tiny_sd3_dir, rollout, diffusers_rollouts.flags).items():
        out = full_disk / name.replace(" ", "-")
        capsys.readouterr()
        assert main([*argv, "--output-dir", str(out)]) == 1, name
        captured = capsys.readouterr()
        errors = [line for line in captured.err.splitlines() if line.startswith("miles: error:")]
        assert len(errors) == 1, (name, captured.err)
        assert errors[0].startswith(f"miles: error: no space left on device: cannot write {out}"), name
        assert "Traceback" not in captured.err + captured.out, name
        assert main([*argv, "--output-dir", str(tmp_path / "x"), "--lr", "fast"]) == 2, name  # a usage mistake
        usage = capsys.readouterr().err
        assert usage.startswith("miles: error:") and "--lr" in usage and "Traceback" not in usage, name


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_finished_run_reached_through_a_symlink_keeps_its_files_byte_for_byte(
    tiny_sd3_dir: Path, diffusers_rollouts, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    finished = diffusers_rollouts.out
    before = _files(finished)
    assert ".miles-finished" in before and "metrics.jsonl" in before  # the fixture's run ended with exit 0
    link = tmp_path / "latest"
    link.symlink_to(finished, target_is_directory=True)
    capsys.readouterr()
    # the same job again through the symlink, and a training job whose --save is that run's folder
    again = ["rollout-only", *diffusers_rollouts.flags, "--output-dir", str(link)]
    saving = ["train", "rl", "--recipe", "tiny-digits-grpo", "--hf-checkpoint", str(tiny_sd3_dir)]
    saving += ["--output-dir", str(tmp_path / "new"), "--save", str(link)]
    for argv, flag in ((again, "--output-dir"), (saving, "--save")):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        errors = [line for line in err.splitlines() if line.startswith("miles: error:")]
        assert len(errors) == 1 and "Traceback" not in err, err
        assert f"{flag} {link}" in err and "a finished rollout-only run" in err, err
    assert _files(finished) == before  # byte for byte: config, images, logs, metrics, marker
    assert not (tmp_path / "new").exists()  # refused before anything was made
