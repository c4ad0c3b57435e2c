"""The cluster check: the plan against this machine's GPUs (or CPUs), skipped when the job joins $RAY_ADDRESS;
and the whole preflight of sd35-4step on a CPU machine: every missing input in one error."""

from __future__ import annotations

from pathlib import Path

import pytest
from preflight_helpers import Job

from miles.core.errors import ConfigError
from miles.preflight import cluster, find_problems, preflight
from miles.preflight.cluster import Machine, check_cluster, count_gpus


def _machine(monkeypatch: pytest.MonkeyPatch, gpus: int, cpus: int) -> None:
    how = f"{gpus} /dev/nvidia* devices" if gpus else "no /dev/nvidia* device, no nvidia-smi GPU"
    monkeypatch.setattr(cluster, "local_machine", lambda: Machine(gpus=gpus, cpus=cpus, how=how))


def test_a_gpu_plan_on_a_small_cpu_machine_is_refused(job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    _machine(monkeypatch, gpus=0, cpus=2)
    assert check_cluster(job("dmd2", recipe="sd35-4step")) == [
        "cluster: the plan needs 8 GPUs on 1 node(s) but this machine has no GPU (no /dev/nvidia* device, no "
        "nvidia-smi GPU) and 2 CPUs, too few to run 8 GPU slots on CPU (at most 2 a CPU); run it on a GPU machine "
        "(or set RAY_ADDRESS to a GPU cluster), plan only with `miles plan --recipe sd35-4step --cluster 1x8`, "
        "or start from a CPU recipe such as tiny-digits-4step (`miles recipes` lists them)"
    ]


def test_a_plan_that_fits_the_cpus_passes(job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    _machine(monkeypatch, gpus=0, cpus=2)
    assert check_cluster(job("rl")) == []  # tiny-digits-grpo: 2 slots
    assert check_cluster(job("rl", num_gpus_per_node=4, actor_num_gpus_per_node=2)) == []  # 2 slots a CPU
    _machine(monkeypatch, gpus=0, cpus=4)
    assert check_cluster(job("dmd2", recipe="sd35-4step")) == []


def test_a_ray_this_process_already_joined_is_the_clusters_view(job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    """A simulated-GPU cluster a test (or a notebook) started: the runtime plans against Ray's view."""
    import sys
    import types

    _machine(monkeypatch, gpus=0, cpus=2)
    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(is_initialized=lambda: True))
    assert check_cluster(job("dmd2", recipe="sd35-4step")) == []


def test_a_plan_larger_than_the_gpus_is_the_placement_error(job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    _machine(monkeypatch, gpus=1, cpus=16)
    (line,) = check_cluster(job("dmd2", recipe="sd35-4step"))
    assert line.startswith("placement: the trainer (8 GPUs on each of 1 node(s)")
    assert line.endswith("(1 /dev/nvidia* devices; $RAY_ADDRESS unset, so the job starts its own Ray here)")


def test_nothing_is_checked_against_a_ray_cluster(job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    _machine(monkeypatch, gpus=0, cpus=1)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert check_cluster(job("dmd2", recipe="sd35-4step")) == []


def test_cuda_visible_devices_narrows_the_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cluster.glob, "glob", lambda pattern: ["/dev/nvidia0", "/dev/nvidia1", "/dev/nvidiactl"])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert count_gpus() == (2, "2 /dev/nvidia* devices")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert count_gpus() == (1, "2 /dev/nvidia* devices (CUDA_VISIBLE_DEVICES=1)")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert count_gpus()[0] == 0


def test_sd35_4step_here_names_every_missing_input_at_once(
    job: Job, monkeypatch: pytest.MonkeyPatch, hf_cache: Path, tmp_path: Path
) -> None:
    _machine(monkeypatch, gpus=0, cpus=2)
    # the recipe's own data and --save paths, moved where no machine has them (or lacks the right to write)
    resolved = job(
        "dmd2", recipe="sd35-4step", prompt_data="/nonexistent/flowgrpo/train.jsonl", save=str(tmp_path / "ckpt")
    )
    problems = find_problems(resolved)
    assert [line.split(" ", 1)[0] for line in problems] == ["--hf-checkpoint", "--prompt-data", "cluster:"]
    assert problems[0].startswith(
        "--hf-checkpoint (and --teacher-checkpoint) stabilityai/stable-diffusion-3.5-medium: neither a local "
        f"folder nor in the Hugging Face cache {hf_cache}, HF_HUB_OFFLINE=1"
    )
    assert problems[1] == "--prompt-data /nonexistent/flowgrpo/train.jsonl: prompt data file not found"
    with pytest.raises(ConfigError) as info:
        preflight(resolved)
    assert str(info.value) == "3 problems:\n" + "\n".join(f"  - {line}" for line in problems)
