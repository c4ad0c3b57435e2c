"""One job per output directory: the `flock` on `<output-dir>/.miles.lock` (torch-free, no Ray).

A second job on a directory in use refuses with one line naming the holder (pid, command) and writes nothing there;
the kernel drops the lock with its holder, so a lock file left by a killed job does not block."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from miles.config.resolve import ResolvedJob, resolve
from miles.core.errors import ConfigError
from miles.runtime.output import LOCK_FILE, lock_output_dir, prepare_output_dir, release_output_dir

ROOT = Path(__file__).resolve().parents[2]
Holder = tuple[subprocess.Popen[str], Path]  # the first job (a subprocess holding the lock) and its output dir
BASE = {
    "hf_checkpoint": "tiny-sd3",
    "prompt_data": "p.jsonl",
    "rm_type": "digit",
    "rollout_batch_size": 8,
    "n_samples_per_prompt": 4,
    "diffusion_num_sde_steps": 2,
    "actor_num_gpus_per_node": 1,
    "num_gpus_per_node": 1,
}

# A first job: prepares the output dir (lock + config files), says so, then holds it until stdin closes.
HOLDER = textwrap.dedent(
    """
    import sys
    from miles.config.resolve import resolve
    from miles.runtime.output import prepare_output_dir
    cli = {**BASE, "output_dir": sys.argv[1], "seed": 1}
    prepare_output_dir(resolve("rl", cli=cli))
    print("ready", flush=True)
    sys.stdin.read()
    """
)


def job(out: Path, **cli: object) -> ResolvedJob:
    return resolve("rl", cli={**BASE, "output_dir": str(out), **cli})


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[Holder]:
    out = tmp_path / "run"
    script = f"BASE = {BASE!r}\n{HOLDER}"
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(out), "--a-marker-arg"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    yield proc, out
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)


def test_a_second_job_on_a_directory_in_use_is_refused_and_writes_nothing(holder: Holder) -> None:
    proc, out = holder
    before = {name: (out / name).read_bytes() for name in ("config.yaml", "config.json", LOCK_FILE)}
    assert "seed: 1" in before["config.yaml"].decode()
    with pytest.raises(ConfigError) as excinfo:
        prepare_output_dir(job(out, seed=2))
    message = str(excinfo.value)
    assert "\n" not in message
    assert message.startswith(f"--output-dir {out}: in use by another job (pid {proc.pid}, started ")
    assert "-c " in message and "--a-marker-arg" in message  # the holder's command line
    assert message.endswith("); wait for it to end or give another --output-dir")
    assert {name: (out / name).read_bytes() for name in before} == before  # nothing of the first is overwritten
    assert json.loads(before[LOCK_FILE])["pid"] == proc.pid


def test_the_lock_dies_with_its_holder(holder: Holder) -> None:
    proc, out = holder
    proc.kill()  # no chance to clean up: the lock file stays, the kernel drops the lock
    proc.wait(timeout=10)
    assert (out / LOCK_FILE).exists()
    prepare_output_dir(job(out, seed=2))
    try:
        assert "seed: 2" in (out / "config.yaml").read_text()
        assert json.loads((out / LOCK_FILE).read_text())["pid"] == os.getpid()
    finally:
        release_output_dir(out)


def test_a_stale_lock_file_does_not_block(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / LOCK_FILE).write_text('{"pid": 999999, "command": "miles train rl", "started": "yesterday"}\n')
    lock = lock_output_dir(out)
    try:
        assert json.loads((out / LOCK_FILE).read_text())["pid"] == os.getpid()
        assert lock_output_dir(out) is lock  # re-entrant within one process
    finally:
        lock.release()
    lock_output_dir(out).release()  # free again after the release


def test_an_output_dir_that_is_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    with pytest.raises(ConfigError, match=r"^--output-dir .*/f: exists and is not a directory$"):
        lock_output_dir(tmp_path / "f")
