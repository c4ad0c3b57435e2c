"""What a user sees when something fails inside a job: the CLI in a subprocess, a real local Ray, tiny-sd3.

Each failure class ends the job within 30 s of the failure with one `miles: error:` line that names the actor
(or the hook) and a log, no traceback on the terminal, and no Ray process of the job left behind: a trainer
rank killed mid-step, a reward function that raises, a reward past --hook-timeout, Ctrl-C (exit 130, the last
complete checkpoint named), SIGTERM (143) and a driver killed with SIGKILL (the reaper ends its cluster).
Signals also arrive while the driver waits in Ray on something that does not return: a stalled trainer, a reward
that hangs, a checkpoint save on a disk that stopped answering (a frozen filesystem: root, skipped otherwise).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SMALL = ["--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--rollout-microgroup-size", "2"]
SMALL += ["--global-batch-size", "8", "--micro-batch-size", "8", "--diffusion-num-steps", "6"]
SMALL += ["--diffusion-num-sde-steps", "2", "--diffusion-sde-window-range", "0,6", "--skip-eval-before-train"]
CLI = [sys.executable, "-c", "from miles_cli.main import entry; entry()"]
HOOKS = """
import time


def bad_loss(args, batch, model_output):
    return 1 / 0


async def raising_rm(args, samples):
    raise KeyError("label")


def stalled_loss(args, batch, model_output):
    time.sleep(600)


async def slow_rm(args, samples):
    time.sleep(600)
    return [0.0] * len(samples)
"""


class Job:
    """One `miles train rl` in a subprocess; `act(job)` runs on a timer once an engine is ready."""

    def __init__(self, tmp_path: Path, extra: list[str], tiny_sd3_dir: Path) -> None:
        (tmp_path / "job_hooks.py").write_text(HOOKS)
        self.out = tmp_path / "run"
        self.argv = [*CLI, "train", "rl", "--recipe", "tiny-digits-grpo", "--hf-checkpoint", str(tiny_sd3_dir)]
        self.argv += [*SMALL, "--num-rollout", "50", "--output-dir", str(self.out), *extra]
        self.env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        self.acted_at: float | None = None
        self.ended_at = 0.0
        self.text = ""
        self.rc: int | None = None
        self.proc: subprocess.Popen | None = None

    def run(self, act: Callable[[Job], None] | None = None, when: str = "ready", delay: float = 3.0) -> Job:
        self.proc = subprocess.Popen(
            self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=self.env
        )
        lines: list[str] = []
        timer = None

        def fire() -> None:
            self.acted_at = time.monotonic()
            assert act is not None
            act(self)

        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            lines.append(line)
            if act is not None and timer is None and when in line:
                timer = threading.Timer(delay, fire)
                timer.start()
        self.rc = self.proc.wait(timeout=120)
        self.ended_at = time.monotonic()
        self.text = "".join(lines)
        return self

    def actor_pid(self, role: str) -> int:
        for line in (self.out / "logs" / "actors.jsonl").read_text().splitlines():
            record = json.loads(line)
            if record["role"] == role and record["event"] == "start":
                return int(record["pid"])
        raise AssertionError(f"no {role} in the registry")

    def errors(self) -> list[str]:
        return [line for line in self.text.splitlines() if line.startswith("miles: error:")]

    def seconds_after_act(self) -> float:
        assert self.acted_at is not None, self.text[-3000:]
        return self.ended_at - self.acted_at


def session_dir(out: Path) -> str:
    match = re.search(r"ray session: (\S+)", (out / "logs" / "driver.log").read_text())
    assert match, "driver.log names no ray session"
    return match.group(1)


def left_behind(out: Path, wait_s: float = 10.0) -> list[str]:
    """The processes of the job's Ray session still running after `wait_s` at most."""
    needle = session_dir(out).encode()
    deadline = time.monotonic() + wait_s
    while True:
        alive = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if needle in cmdline:
                alive.append(f"{entry.name} {cmdline[:120]!r}")
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.5)


NOISE = (
    "Started a local Ray instance",
    "Token authentication",
    "worker processes have been started",
    "repeated",
    "(raylet)",
    "pid=",
    "Traceback",
)


def assert_one_clean_line(job: Job) -> str:
    """One error line, and a quiet terminal: Ray's notices and the actors' output went to logs/."""
    errors = job.errors()
    assert len(errors) == 1, job.text[-4000:]
    for noise in NOISE:
        assert noise not in job.text, (noise, job.text[-4000:])
    assert re.search(r"^miles: diffusers engine 0 \(node 0, CPU, pid \d+\) ready$", job.text, re.MULTILINE)
    # Ray's own notices went to the run's log (its start-up line is always there; a notice such as "Token
    # authentication is enabled" only where Ray says it, which depends on the machine's Ray state)
    assert "Started a local Ray instance" in (job.out / "logs" / "driver.log").read_text()
    return errors[0]


def test_a_trainer_rank_killed_mid_step_ends_the_job_naming_it(tiny_sd3_dir: Path, tmp_path: Path) -> None:
    job = Job(tmp_path, [], tiny_sd3_dir)
    job.run(lambda j: os.kill(j.actor_pid("actor"), signal.SIGKILL), when="rollout 1 ", delay=0.2)
    assert job.rc == 1, job.text[-4000:]
    line = assert_one_clean_line(job)
    pid = job.actor_pid("actor")
    assert line.startswith("miles: error: actor 0 on node ") and f"(pid {pid}) died: its process ended" in line
    assert line.endswith(f"full log: {job.out / 'logs' / 'actor-0.log'}")
    assert job.seconds_after_act() < 30
    assert left_behind(job.out) == []


# extended: ~22 s; tests/runtime/test_actor_failures.py checks the line of a raising actor on real Ray
@pytest.mark.extended
def test_a_reward_that_raises_ends_the_job_with_one_line(tiny_sd3_dir: Path, tmp_path: Path) -> None:
    job = Job(tmp_path, ["--custom-rm-path", "job_hooks.raising_rm"], tiny_sd3_dir).run()
    assert job.rc == 1, job.text[-4000:]
    line = assert_one_clean_line(job)
    assert line.startswith("miles: error: custom reward job_hooks.raising_rm failed on 8 samples: sample 0 (prompt ")
    assert line.endswith(f"KeyError: 'label' (logs: {job.out / 'logs'})")
    assert "KeyError" in (job.out / "logs" / "rollout_manager-0.log").read_text()  # the traceback, for the user
    assert left_behind(job.out) == []


# extended: ~25 s; test_actor_failures.py::test_a_hook_past_its_deadline_... checks the deadline on real Ray
@pytest.mark.extended
def test_a_reward_past_the_hook_timeout_ends_the_job_naming_it(tiny_sd3_dir: Path, tmp_path: Path) -> None:
    job = Job(tmp_path, ["--custom-rm-path", "job_hooks.slow_rm", "--hook-timeout", "3"], tiny_sd3_dir)
    start = time.monotonic()
    job.run()
    assert job.rc == 1, job.text[-4000:]
    line = assert_one_clean_line(job)
    assert line.startswith(
        "miles: error: --custom-rm-path job_hooks.slow_rm did not return within 3 s (--hook-timeout); its stack is "
        "in the log"
    )
    assert "slow_rm" in (job.out / "logs" / "rollout_manager-0.log").read_text()  # where it hung
    assert time.monotonic() - start < 120
    assert left_behind(job.out) == []


def test_ctrl_c_stops_the_job_and_names_the_last_complete_checkpoint(tiny_sd3_dir: Path, tmp_path: Path) -> None:
    save = tmp_path / "ckpt"
    job = Job(tmp_path, ["--save", str(save), "--save-interval", "1"], tiny_sd3_dir)
    job.run(lambda j: j.proc.send_signal(signal.SIGINT), when="rollout 1 ", delay=0.5)
    assert job.rc == 130, job.text[-4000:]
    assert "Traceback" not in job.text and job.errors() == []
    step = int((save / "latest_checkpointed_iteration.txt").read_text())
    assert (save / f"iter_{step:07d}" / "model.pt").is_file()  # the latest is complete
    assert f"miles: interrupted (Ctrl-C); last complete checkpoint: {save} step {step}" in job.text
    assert job.seconds_after_act() < 30
    assert left_behind(job.out) == []


def test_a_driver_killed_with_sigkill_leaves_no_ray_process(tiny_sd3_dir: Path, tmp_path: Path) -> None:
    job = Job(tmp_path, [], tiny_sd3_dir).run(lambda j: j.proc.kill(), when="rollout 0 ", delay=0.5)
    assert job.rc == -signal.SIGKILL
    assert left_behind(job.out, wait_s=15.0) == []


def test_sigterm_while_the_driver_waits_on_a_stalled_trainer_exits_143_with_the_line(
    tiny_sd3_dir: Path, tmp_path: Path
) -> None:
    """The driver spends a real job's time waiting in Ray: a signal there (Ray raises its own KeyboardInterrupt)
    still says the interrupted line, exits 128 + the signal and leaves nothing running."""
    extra = ["--loss-type", "custom_loss", "--custom-loss-function-path", "job_hooks.stalled_loss"]
    job = Job(tmp_path, extra, tiny_sd3_dir).run(lambda j: j.proc.terminate(), when="ready", delay=12.0)
    assert job.rc == 143, job.text[-4000:]
    assert "miles: interrupted (SIGTERM); no checkpoint (no --save)" in job.text, job.text[-4000:]
    assert "Traceback" not in job.text and job.errors() == []
    assert "rollout 0 " not in job.text  # it was stalled in the trainer, not between rollouts
    assert job.seconds_after_act() < 30
    assert left_behind(job.out) == []


@pytest.mark.extended
def test_ctrl_c_while_the_rollout_is_stuck_in_a_reward_exits_130_with_the_line(
    tiny_sd3_dir: Path, tmp_path: Path
) -> None:
    """The other long wait: the driver waits on the rollout manager while a reward hangs (past no timeout)."""
    extra = ["--custom-rm-path", "job_hooks.slow_rm", "--hook-timeout", "0"]
    job = Job(tmp_path, extra, tiny_sd3_dir).run(lambda j: j.proc.send_signal(signal.SIGINT), when="ready", delay=8.0)
    assert job.rc == 130, job.text[-4000:]
    assert "miles: interrupted (Ctrl-C); no checkpoint (no --save)" in job.text, job.text[-4000:]
    assert "Traceback" not in job.text and job.errors() == []
    assert job.seconds_after_act() < 30
    assert left_behind(job.out) == []


@pytest.mark.extended
def test_ctrl_c_while_the_engine_is_stuck_exits_130_with_the_line(tiny_sd3_dir: Path, tmp_path: Path) -> None:
    """The third wait: the engine stops answering mid-rollout (its process stopped, as a wedged GPU looks from
    outside); Ctrl-C still ends the job with the line, and the stopped engine does not outlive it."""

    def stop_the_engine_then_interrupt(job: Job) -> None:
        os.kill(job.actor_pid("engine"), signal.SIGSTOP)
        time.sleep(3.0)
        job.acted_at = time.monotonic()
        job.proc.send_signal(signal.SIGINT)

    job = Job(tmp_path, [], tiny_sd3_dir).run(stop_the_engine_then_interrupt, when="ready", delay=2.0)
    assert job.rc == 130, job.text[-4000:]
    assert "miles: interrupted (Ctrl-C); no checkpoint (no --save)" in job.text, job.text[-4000:]
    assert "Traceback" not in job.text and job.errors() == []
    assert "rollout 0 " not in job.text  # it was stuck in the first rollout
    assert job.seconds_after_act() < 30
    assert left_behind(job.out) == []


@pytest.mark.extended
def test_sigterm_stops_the_job_with_143(tiny_sd3_dir: Path, tmp_path: Path) -> None:
    job = Job(tmp_path, [], tiny_sd3_dir).run(lambda j: j.proc.terminate(), when="rollout 0 ", delay=0.5)
    assert job.rc == 143, job.text[-4000:]
    assert "miles: interrupted (SIGTERM); no checkpoint (no --save)" in job.text and "Traceback" not in job.text
    assert left_behind(job.out) == []


@pytest.mark.extended
def test_a_custom_loss_that_raises_is_one_usage_line_naming_the_hook(tiny_sd3_dir: Path, tmp_path: Path) -> None:
    extra = ["--loss-type", "custom_loss", "--custom-loss-function-path", "job_hooks.bad_loss"]
    job = Job(tmp_path, extra, tiny_sd3_dir).run()
    assert job.rc == 2, job.text[-4000:]
    line = assert_one_clean_line(job)
    assert line == (
        "miles: error: --custom-loss-function-path 'job_hooks.bad_loss' raised ZeroDivisionError: division by zero "
        f"(traceback in {job.out / 'logs' / 'actor-0.log'})"
    )
    assert left_behind(job.out) == []


class FrozenDisk:
    """A small ext4 filesystem on a loop device that `freeze()` stops answering writes (`fsfreeze`): a writer
    blocks in the kernel, as on a hung NFS server or a dead disk, until `thaw()`."""

    def __init__(self, where: Path) -> None:
        self.where = where
        self.frozen = False

    def freeze(self) -> None:
        subprocess.run(["fsfreeze", "-f", str(self.where)], check=True)
        self.frozen = True

    def thaw(self) -> None:
        if self.frozen:
            subprocess.run(["fsfreeze", "-u", str(self.where)], check=False)
            self.frozen = False


@pytest.fixture
def frozen_disk(tmp_path: Path) -> Iterator[FrozenDisk]:
    if os.geteuid() != 0:
        pytest.skip("mounting a loop filesystem and freezing it needs root")
    image, where = tmp_path / "disk.img", tmp_path / "disk"
    where.mkdir()
    with open(image, "wb") as handle:
        handle.truncate(64 << 20)
    made = subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], capture_output=True)
    mounted = made.returncode == 0 and subprocess.run(["mount", "-o", "loop", str(image), str(where)]).returncode == 0
    if not mounted:
        pytest.skip(f"cannot make a loop ext4 filesystem here: {made.stderr.decode().strip()}")
    disk = FrozenDisk(where)
    try:
        yield disk
    finally:
        disk.thaw()
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.mark.extended
def test_sigterm_while_a_checkpoint_save_is_stalled_on_the_disk_exits_143_naming_the_last_complete_one(
    tiny_sd3_dir: Path, tmp_path: Path, frozen_disk: FrozenDisk
) -> None:
    """Rollout 0's checkpoint completes; then the --save disk stops answering, rollout 1's save hangs in the kernel
    and SIGTERM arrives: the driver does not wait on the hung save, names step 0 and exits 143; once the disk
    answers again nothing of the job is left and step 0 is whole."""
    save = frozen_disk.where / "ckpt"
    latest = save / "latest_checkpointed_iteration.txt"

    def freeze_after_the_first_checkpoint() -> None:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            if latest.is_file() and latest.read_text().strip() == "0":
                frozen_disk.freeze()
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=freeze_after_the_first_checkpoint, daemon=True)
    watcher.start()
    job = Job(tmp_path, ["--save", str(save), "--save-interval", "1"], tiny_sd3_dir)
    try:
        job.run(lambda j: j.proc.terminate(), when="rollout 1 ", delay=3.0)  # "rollout 1" is logged, then it saves
        assert frozen_disk.frozen, "the first checkpoint never completed"
        assert job.rc == 143, job.text[-4000:]
        assert f"miles: interrupted (SIGTERM); last complete checkpoint: {save} step 0" in job.text, job.text[-4000:]
        assert "Traceback" not in job.text and job.errors() == []
        assert job.seconds_after_act() < 30
    finally:
        frozen_disk.thaw()
    assert left_behind(job.out, wait_s=20.0) == []
    assert latest.read_text() == "0\n"
    assert (save / "iter_0000000" / "model.pt").is_file() and not (save / "iter_0000001").exists()
