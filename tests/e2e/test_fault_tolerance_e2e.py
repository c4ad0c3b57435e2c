"""The in-process engines' fault tolerance through the CLI (a subprocess each, real Ray, tiny-sd3).

With --use-fault-tolerance and --ci-test the manager crashes engine 0 in rollout 2 (the reference's CI fault
injection): `train rl` restarts it, re-pushes the synced weights and completes with every sample. Without
fault tolerance a killed engine ends `rollout-only` with one error line naming the engine, exit code 1.
"""

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

pytestmark = pytest.mark.slow

SMALL = ["--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--rollout-microgroup-size", "2"]
SMALL += ["--global-batch-size", "8", "--micro-batch-size", "8", "--diffusion-num-steps", "6"]
SMALL += ["--diffusion-num-sde-steps", "2", "--diffusion-sde-window-range", "0,6"]
CLI = [sys.executable, "-c", "from miles_cli.main import entry; entry()"]


def _run(argv: list[str], on_line=None, timeout: float = 600.0) -> tuple[int, str]:
    proc = subprocess.Popen([*CLI, *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    for line in proc.stdout:
        lines.append(line)
        if on_line is not None:
            on_line(line)
        if time.monotonic() > deadline:
            proc.kill()
            break
    return proc.wait(timeout=120), "".join(lines)


def test_train_rl_completes_when_ci_fault_injection_kills_an_engine(
    tiny_sd3_dir: Path, tmp_path: Path, small_digit_eval: list[str]
) -> None:
    out = tmp_path / "run"
    argv = ["train", "rl", "--recipe", "tiny-digits-grpo", "--hf-checkpoint", str(tiny_sd3_dir), *SMALL]
    argv += small_digit_eval
    argv += ["--num-rollout", "3", "--use-fault-tolerance", "--rollout-health-check-interval", "2"]
    argv += ["--ci-test", "--ci-metric-checker-key", "rollout/num_samples", "--ci-metric-checker-threshold", "8"]
    rc, text = _run([*argv, "--output-dir", str(out)])
    assert rc == 0, text[-4000:]
    assert "CI fault injection (--ci-test --use-fault-tolerance): crashing diffusers engine 0" in text
    restarted = [line for line in text.splitlines() if "restarted diffusers engine 0" in line]
    assert len(restarted) == 1, text[-4000:]
    assert "weights of sync 2 re-pushed, verified (" in restarted[0]  # rollout 2 samples with version 2
    *rows, final = read_metrics(out / "metrics.jsonl")
    assert [r["rollout_id"] for r in rows] == [0, 1, 2]
    assert all(r["rollout/num_samples"] == 8.0 for r in rows)
    assert final["rollout_id"] == 3 and final["eval/digits/num_samples"] == 10  # the restarted engine evaluates
    assert "CI check passed: rollout/num_samples = 8" in text


# extended: ~35 s; tests/rollout/test_engine_fault_tolerance.py checks the same error line on the engine actors
@pytest.mark.extended
def test_a_killed_engine_without_fault_tolerance_is_one_error_naming_it(tiny_sd3_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    argv = ["rollout-only", "--recipe", "tiny-digits-grpo", "--hf-checkpoint", str(tiny_sd3_dir), *SMALL]
    argv += ["--num-rollout", "50", "--rollout-health-check-interval", "1", "--output-dir", str(out)]
    found: list[int] = []

    def kill_engine(line: str) -> None:
        match = re.search(r"diffusers engine 0 \(node 0, CPU, pid (\d+)\) ready", line)
        if match and not found:
            found.append(int(match.group(1)))
            threading.Timer(3.0, os.kill, (found[0], signal.SIGKILL)).start()  # mid-run

    rc, text = _run(argv, kill_engine)
    assert found, text[-4000:]
    assert rc == 1, text[-4000:]
    errors = [line for line in text.splitlines() if line.startswith("miles: error:")]
    assert len(errors) == 1, text[-4000:]
    assert errors[0].startswith(f"miles: error: diffusers engine 0 (node 0, CPU, pid {found[0]}) failed: ")
    assert "Pass --use-fault-tolerance to restart dead engines and go on. (logs: " in errors[0]
    assert "Traceback" not in text
    assert not (out / "rollout_49.pt").exists()
