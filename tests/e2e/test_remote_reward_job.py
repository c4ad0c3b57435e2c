"""A job scoring through `miles reward serve` on loopback (`--rm-type remote_rm`): the CLI in subprocesses, a real
local Ray, tiny-sd3, a real HTTP service.

- The digit reward served remotely gives a 3-rollout run whose metrics equal the in-process run's, to the bit.
- A service that dies mid-rollout: without --use-fault-tolerance the job ends with one line naming the URL within
  30 s of the death (exit 1); with it, the job waits for the service (restarted on the same port), re-sends the
  unfinished batches and completes with every sample scored. (Both `extended`: their parts run in the default
  suite, named at each test.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

CLI = [sys.executable, "-c", "from miles_cli.main import entry; entry()"]
SMALL = ["--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--rollout-microgroup-size", "2"]
SMALL += ["--global-batch-size", "8", "--micro-batch-size", "8", "--diffusion-num-steps", "6"]
SMALL += ["--diffusion-num-sde-steps", "2", "--diffusion-sde-window-range", "0,6", "--skip-eval-before-train"]
REWARDS = '''
import os

from miles.rewards.dispatch import batched_async_rm


class _Digit:
    def __init__(self, args):
        self._args, self.custom_rm_path, self.rm_type, self.reward_weights = args, None, ["digit"], None

    def __getattr__(self, name):
        return getattr(self._args, name)


async def digit_or_die(args, samples):
    """The digit reward; the first call in a fresh service (no marker file yet) kills the service instead."""
    marker = os.environ["MILES_TEST_DIE_MARKER"]
    if not os.path.exists(marker):
        with open(marker, "w") as f:
            f.write(str(os.getpid()))
        os._exit(1)
    return await batched_async_rm(_Digit(args), samples)
'''


class Service:
    """`miles reward serve` in a subprocess; `restart()` starts it again on the same port."""

    def __init__(self, tmp_path: Path, argv: list[str], env: dict[str, str]) -> None:
        self.tmp_path, self.argv, self.env = tmp_path, argv, env
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def start(self) -> Service:
        ready = self.tmp_path / f"ready-{time.monotonic_ns()}"
        argv = [*CLI, "reward", "serve", *self.argv, "--port", str(self.port), "--ready-file", str(ready)]
        log = (self.tmp_path / "service.log").open("a")
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + 60
        while not ready.is_file():
            assert self.proc.poll() is None, (self.tmp_path / "service.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the reward service did not start"
            time.sleep(0.1)
        self.url = ready.read_text().strip()
        self.port = int(self.url.rsplit(":", 1)[1])
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)


def run_job(out: Path, extra: list[str], env: dict[str, str], tiny_sd3_dir: Path) -> tuple[int, str, float]:
    argv = [*CLI, "train", "rl", "--recipe", "tiny-digits-grpo", "--hf-checkpoint", str(tiny_sd3_dir), *SMALL]
    argv += ["--output-dir", str(out), "--deterministic-mode", *extra]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
    return done.returncode, done.stdout + done.stderr, time.monotonic()


def metrics(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{k: v for k, v in row.items() if not k.startswith("perf/")} for row in rows]


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "job_rewards.py").write_text(REWARDS)
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "MILES_TEST_DIE_MARKER": str(tmp_path / "died")}


def test_a_remote_digit_reward_gives_the_in_process_runs_metrics(
    tiny_sd3_dir: Path, tmp_path: Path, env: dict[str, str], small_digit_eval: list[str]
) -> None:
    service = Service(tmp_path, ["--rm-type", "digit", "--hf-checkpoint", str(tiny_sd3_dir)], env).start()
    try:
        rc, text, _ = run_job(tmp_path / "local", ["--num-rollout", "3", *small_digit_eval], env, tiny_sd3_dir)
        assert rc == 0, text[-3000:]
        remote = ["--num-rollout", "3", "--rm-type", "remote_rm", "--rm-url", service.url, "--rm-batch-size", "3"]
        remote += small_digit_eval
        rc, text, _ = run_job(tmp_path / "remote", remote, env, tiny_sd3_dir)
        assert rc == 0, text[-3000:]
    finally:
        service.stop()
    local, served = metrics(tmp_path / "local"), metrics(tmp_path / "remote")
    assert len(local) == len(served) == 4  # three rollouts, then the eval set (scored by the service too)
    assert served == local  # every metric of every rollout and of the final eval, to the bit
    assert local[3]["eval/digits/num_samples"] == 10
    assert local[0]["rollout/reward/raw_mean"] > 0


# extended (~50 s, a service and a job): the client's one line within 30 s of a killed service is
# tests/rewards/test_reward_service.py::test_killed_service_without_fault_tolerance_fails_within_30_s, the job's
# dispatch to the service the test above, and a failure inside the job's actors as one line
# tests/e2e/test_job_failures.py::test_a_trainer_rank_killed_mid_step_ends_the_job_naming_it
@pytest.mark.extended
def test_a_dead_service_without_fault_tolerance_ends_the_job_in_one_line(
    tiny_sd3_dir: Path, tmp_path: Path, env: dict[str, str]
) -> None:
    argv = ["--custom-rm-path", "job_rewards.digit_or_die", "--hf-checkpoint", str(tiny_sd3_dir)]
    service = Service(tmp_path, argv, env).start()
    try:
        extra = ["--num-rollout", "2", "--rm-type", "remote_rm", "--rm-url", service.url]
        rc, text, ended = run_job(tmp_path / "run", extra, env, tiny_sd3_dir)
    finally:
        service.stop()
    died = (tmp_path / "died").stat().st_mtime
    assert rc == 1, text[-3000:]
    errors = [line for line in text.splitlines() if line.startswith("miles: error:")]
    assert len(errors) == 1 and "Traceback" not in text, text[-3000:]
    assert service.url in errors[0] and "unreachable" in errors[0], errors[0]
    assert time.time() - (time.monotonic() - ended) - died < 30  # the job ended within 30 s of the death


# extended (~60 s, a service, its restart and a job): the client's wait and re-sent batches are
# tests/rewards/test_reward_service.py::test_killed_service_with_fault_tolerance_is_waited_for_and_every_item_scored,
# the job's --use-fault-tolerance and --rm-fault-wait reaching the dispatch tests/rewards/test_remote_flags.py::
# test_a_service_that_comes_back_is_waited_for_under_fault_tolerance and
# ::test_rm_fault_wait_bounds_the_wait_for_a_service_that_is_down
@pytest.mark.extended
def test_a_dead_service_with_fault_tolerance_is_waited_for_and_every_sample_scored(
    tiny_sd3_dir: Path, tmp_path: Path, env: dict[str, str], small_digit_eval: list[str]
) -> None:
    argv = ["--custom-rm-path", "job_rewards.digit_or_die", "--hf-checkpoint", str(tiny_sd3_dir)]
    service = Service(tmp_path, argv, env).start()
    stop = threading.Event()
    restarts: list[float] = []

    def restarter() -> None:  # a supervisor of the user's: brings the service back on its port
        while not stop.is_set():
            if service.proc is not None and service.proc.poll() is not None:
                time.sleep(2.0)  # down for a while: the job must wait, not fail
                service.start()
                restarts.append(time.monotonic())
            time.sleep(0.2)

    thread = threading.Thread(target=restarter, daemon=True)
    thread.start()
    try:
        extra = ["--num-rollout", "2", "--rm-type", "remote_rm", "--rm-url", service.url, "--use-fault-tolerance"]
        extra += ["--rm-fault-wait", "60", *small_digit_eval]
        rc, text, _ = run_job(tmp_path / "run", extra, env, tiny_sd3_dir)
    finally:
        stop.set()
        thread.join(timeout=10)
        service.stop()
    assert rc == 0, text[-3000:]
    assert (tmp_path / "died").is_file() and len(restarts) == 1
    *rows, final = metrics(tmp_path / "run")
    assert [r["rollout_id"] for r in rows] == [0, 1] and final["eval/digits/num_samples"] == 10
    assert all(r["rollout/num_samples"] == 8.0 for r in rows)  # 2 prompts x 4 samples, every one scored
    assert all(0 < r["rollout/reward/raw_mean"] <= 1 for r in rows)
