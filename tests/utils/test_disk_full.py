"""A full disk is one line naming the path and "no space left on device", and what was whole stays whole.

Each test writes onto a small tmpfs mount of its own (root; skipped with the reason otherwise) that it fills:
atomic files (images, rollouts, configs), metrics.jsonl rows, checkpoints, the driver's log, and the failure line
for a write that ran out of space in the driver or inside a Ray actor.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from miles.utils.disk import DiskFull, is_disk_full


@contextlib.contextmanager
def _tmpfs(where: Path, size: str) -> Iterator[Path]:
    where.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    with _tmpfs(tmp_path / "disk", "256k") as where:
        yield where


def _fill(disk: Path) -> None:
    """Fill the disk to the last byte (a file of its own, `filler`)."""
    fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        with contextlib.suppress(OSError):
            while os.write(fd, b"\0" * 4096):
                pass
    finally:
        os.close(fd)


def test_an_atomic_file_on_a_full_disk_is_disk_full_and_the_old_file_stays(small_disk: Path) -> None:
    from miles.utils.atomic import atomic_write_text

    target = small_disk / "config.yaml"
    atomic_write_text(target, "old: 1\n")
    _fill(small_disk)
    with pytest.raises(DiskFull) as caught:
        atomic_write_text(target, "new: 2\n" * 50_000)
    assert str(caught.value).startswith(f"no space left on device: cannot write {target}")
    assert target.read_text() == "old: 1\n"
    assert [p.name for p in small_disk.iterdir() if p.name.startswith(".config.yaml.tmp")] == []  # no temp left


def test_a_metrics_row_that_does_not_fit_is_taken_back(small_disk: Path) -> None:
    from miles.io.metrics import MetricsWriter, read_metrics

    writer = MetricsWriter(small_disk)
    writer.write(0, {"loss": 1.0})
    _fill(small_disk)
    with pytest.raises(DiskFull, match=r"metrics\.jsonl"):
        writer.write(1, {f"key_{i}": float(i) for i in range(20_000)})
    assert read_metrics(small_disk / "metrics.jsonl") == [{"rollout_id": 0, "loss": 1.0}]


def test_a_checkpoint_that_does_not_fit_leaves_the_last_whole_one_the_latest(small_disk: Path) -> None:
    from miles.training.checkpoint import load_checkpoint, save_checkpoint

    save_checkpoint(small_disk, 1, {"model.pt": {"w": torch.zeros(8)}})
    with pytest.raises(DiskFull) as caught:  # torch's writer says "unexpected pos"; the line says what happened
        save_checkpoint(small_disk, 2, {"model.pt": {"w": torch.zeros(200_000)}})
    assert "no space left on device: cannot write" in str(caught.value) and "iter_0000002" in str(caught.value)
    assert (small_disk / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    step, loaded = load_checkpoint(small_disk)
    assert step == 1 and torch.equal(loaded["model.pt"]["w"], torch.zeros(8))
    assert not (small_disk / "iter_0000002").exists()


def test_the_failure_line_of_a_driver_write_needs_no_disk(
    small_disk: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """driver.log on the full disk: the traceback cannot be kept there, which is said once; the failure is one
    line naming the path, exit 1."""
    import miles.runtime.terminal as terminal
    from miles.runtime.failures import report_failure

    logs = small_disk / "logs"
    logs.mkdir()
    saved = terminal._DRIVER_LOG, terminal._LOG_FAILED
    try:
        terminal._DRIVER_LOG, terminal._LOG_FAILED = logs / "driver.log", False
        _fill(small_disk)
        try:
            raise DiskFull(small_disk / "images" / "rollout_000003.png")
        except DiskFull as exc:
            code = report_failure(exc, SimpleNamespace(output_dir=None))
        terminal.write_driver_log("more\n" * 1000)  # nothing raised, nothing said twice
    finally:
        terminal._DRIVER_LOG, terminal._LOG_FAILED = saved
    err = capsys.readouterr().err
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 2, err
    assert lines[0].startswith(f"miles: warning: cannot write {logs / 'driver.log'} (No space left on device)")
    assert lines[1].startswith(
        f"miles: error: no space left on device: cannot write {small_disk / 'images' / 'rollout_000003.png'}"
    )
    assert "Traceback" not in err


@pytest.mark.slow  # a local Ray for the module (~10 s to start): not in the fast tier
def test_a_write_in_an_actor_that_runs_out_of_space_is_one_line(small_disk: Path, local_ray) -> None:
    from miles.runtime.failures import explain

    ray = local_ray

    @ray.remote(num_cpus=0)
    def write(path: str) -> None:
        from miles.utils.atomic import atomic_write_text

        atomic_write_text(path, "x" * 1_000_000)

    _fill(small_disk)
    target = small_disk / "rollouts" / "rollout_0.pt"
    with pytest.raises(Exception) as caught:
        ray.get(write.remote(str(target)))
    failure = explain(caught.value, None)
    assert failure is not None and failure.code == 1
    assert failure.line.startswith(f"no space left on device: cannot write {target}")


def test_only_space_errors_are_disk_full(tmp_path: Path) -> None:
    import errno

    assert is_disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert is_disk_full(RuntimeError("writer failed"), None) is False
    wrapped = RuntimeError("unexpected pos 496512 vs 496404")
    wrapped.__cause__ = OSError(errno.EDQUOT, "Disk quota exceeded")
    assert is_disk_full(wrapped)
    assert not is_disk_full(PermissionError(errno.EACCES, "Permission denied"), tmp_path)  # plenty of space here
