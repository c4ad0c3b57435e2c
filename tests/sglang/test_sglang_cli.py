"""The CLI on the sglang backend: the same files as the diffusers backend, LoRA training with verified
sync, and one clear error when an engine dies without --use-fault-tolerance."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from miles.io.metrics import read_metrics
from miles.io.rollout_file import load_rollout
from miles_cli.main import main

SMALL = [
    "--rollout-batch-size",
    "2",
    "--n-samples-per-prompt",
    "4",
    "--rollout-microgroup-size",
    "4",
    "--global-batch-size",
    "8",
    "--micro-batch-size",
    "8",
    "--diffusion-num-steps",
    "6",
    "--diffusion-num-sde-steps",
    "3",
    "--diffusion-sde-window-range",
    "0,5",
]


def _files(root: Path) -> set[str]:
    """The run's files, without what only one backend has: its engines' logs and the sglang rollout's parser
    actors' logs (`--rollout-parser-num-workers`)."""
    return {
        str(p.relative_to(root))
        for p in root.rglob("*")
        if p.is_file() and "engines" not in p.parts and not p.name.startswith("parser-")
    }


# extended: ~55 s; tests/sglang/test_sglang_engines.py checks the sample contract against the diffusers engine
@pytest.mark.extended
def test_rollout_only_writes_the_same_files_on_both_backends(diffusers_rollouts, tmp_path: Path) -> None:
    runs = {"diffusers": diffusers_rollouts.out}  # the same job on the in-process engine (tests/conftest.py)
    argv = ["rollout-only", *diffusers_rollouts.flags, "--rollout-backend", "sglang"]
    assert main([*argv, "--output-dir", str(tmp_path / "sglang")]) == 0
    runs["sglang"] = tmp_path / "sglang"
    assert _files(runs["sglang"]) == _files(runs["diffusers"])
    assert (runs["sglang"] / "engines" / "sglang_engine_0.log").is_file()
    for rollout_id in (0, 1):
        _, ours, _ = load_rollout(runs["diffusers"] / f"rollout_{rollout_id}.pt")
        _, theirs, _ = load_rollout(runs["sglang"] / f"rollout_{rollout_id}.pt")
        assert [s.seed for s in theirs] == [s.seed for s in ours]
        assert [s.prompt for s in theirs] == [s.prompt for s in ours]
        for a, b in zip(ours, theirs, strict=True):
            assert a.trajectory.latents.shape == b.trajectory.latents.shape
            assert a.trajectory.sde_step_indices == b.trajectory.sde_step_indices
            assert b.trajectory.log_probs.shape == a.trajectory.log_probs.shape
            # same seeds: the same initial noise on both backends
            assert a.trajectory.latents[0].equal(b.trajectory.latents[0])
    names = [row.keys() for row in read_metrics(runs["sglang"] / "metrics.jsonl")]
    assert all("rollout/reward/raw_mean" in keys for keys in names)


# extended: ~65 s; LoRA sync: test_sglang_engines.py (set_lora) and test_sglang_in_place_sync.py (by handle)
@pytest.mark.extended
def test_train_rl_with_lora_syncs_verified_adapters(tiny_sd3_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    argv = ["train", "rl", "--recipe", "tiny-digits-grpo", "--hf-checkpoint", str(tiny_sd3_dir), *SMALL]
    argv += ["--num-rollout", "3", "--rollout-backend", "sglang", "--use-lora", "--lora-rank", "8"]
    argv += ["--lora-alpha", "16", "--lr", "3e-3", "--lr-warmup-iters", "0", "--output-dir", str(out)]
    assert main(argv) == 0
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["rollout_id"] for r in rows] == [0, 1, 2]
    for row in rows:
        assert row["train/log_prob_mean_abs_diff"] <= 1e-4
        assert row["train/log_prob_abs_diff_first_step"] <= 1e-4
        assert row["sync/verified_tensors"] == 66 and row["sync/engines_agree"] == 1.0
    adapters = sorted(p.name for p in (out / "engines" / "weights").glob("lora_v*.safetensors"))
    assert adapters == ["lora_v2.safetensors", "lora_v3.safetensors"]  # the two newest are kept


@pytest.mark.extended  # ~50 s (a server start); the engine tier checks that a dead engine stops the run, named
def test_a_dead_engine_without_fault_tolerance_is_one_clear_error(tiny_sd3_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    argv = [sys.executable, "-c", "from miles_cli.main import entry; entry()", "rollout-only"]
    argv += ["--recipe", "tiny-digits-grpo"]
    argv += ["--hf-checkpoint", str(tiny_sd3_dir), *SMALL[:-6], "--diffusion-num-steps", "10"]
    argv += ["--num-rollout", "50", "--rollout-backend", "sglang"]
    argv += ["--rollout-health-check-interval", "1", "--output-dir", str(out)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    lines: list[str] = []
    pid = None
    deadline = time.monotonic() + 300
    for line in proc.stdout:
        lines.append(line)
        found = re.search(r"sglang engine 0 at \S+ \(pid (\d+)\)", line)
        if found and pid is None:
            pid = int(found.group(1))
            threading.Timer(3.0, os.kill, (pid, signal.SIGKILL)).start()  # mid-rollout
        if time.monotonic() > deadline:
            proc.kill()
            break
    rc = proc.wait(timeout=120)
    text = "".join(lines)
    assert pid is not None, text[-3000:]
    assert rc == 1, text[-3000:]
    errors = [line for line in lines if line.startswith("miles: error:")]
    assert len(errors) == 1, text[-3000:]
    assert "sglang engine 0 at" in errors[0] and f"pid {pid}" in errors[0] and "--use-fault-tolerance" in errors[0]
    assert "Traceback" not in text
    assert not (out / "rollout_49.pt").exists()
