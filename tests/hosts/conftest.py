"""The several-hosts tier: jobs on a Ray cluster of network namespaces on this machine (`netns_cluster`).

Host 0 (10.233.0.11) is Ray's head and runs the job's driver, as a user's login node would, and declares no
GPU; host 1 (10.233.0.12) declares 3 GPUs and host 2 (10.233.0.13) one. Jobs use `--num-gpus-per-node 2`, so
host 1 keeps a declared GPU free (where a lost engine is re-placed). No GPU exists: the actors' tensors stay on
CPU and gloo runs the collectives, over the namespaces' own addresses. Root only (CI runs as root); elsewhere
the tier skips with the reason. Run it with `python -m pytest -q -m hosts tests/hosts`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from netns_cluster import NetnsCluster, available  # noqa: E402

UNAVAILABLE = available()

SMALL = ["--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--rollout-microgroup-size", "4"]
SMALL += ["--global-batch-size", "4", "--micro-batch-size", "2", "--diffusion-num-steps", "6"]
SMALL += ["--diffusion-num-sde-steps", "2", "--diffusion-sde-window-range", "0,6", "--deterministic-mode"]
SMALL += ["--num-gpus-per-node", "2", "--host-timeout", "8"]
SPLIT = ["--actor-num-nodes", "2", "--actor-num-gpus-per-node", "1"]  # ranks on hosts 1 and 2, the engine on 1
TEN = "".join(json.dumps({"input": f"a handwritten digit {d}", "metadata": {"label": d}}) + "\n" for d in range(3))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/hosts/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.hosts)
            item.add_marker(pytest.mark.slow)
            if UNAVAILABLE:
                item.add_marker(pytest.mark.skip(reason=UNAVAILABLE))


@pytest.fixture(scope="session")
def hosts(tiny_sd3_dir: Path):
    import shutil
    import tempfile

    # a short root: Ray's socket paths under it must stay within AF_UNIX's 107 bytes
    root = Path(tempfile.mkdtemp(prefix="mh", dir="/tmp"))
    cluster = NetnsCluster(root=root, gpus=(0, 3, 1), cpus=2)
    try:
        yield cluster.start()
    finally:
        cluster.close()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def healthy(hosts: NetnsCluster):
    """The cluster with every host up after the test (a fault test breaks one)."""
    yield hosts
    for index in range(1, len(hosts.hosts)):
        hosts.heal(index)


def workdir(tmp_path: Path, name: str) -> Path:
    """A driver's folder with the small eval file (`--eval-prompt-data d ten.jsonl`, relative)."""
    path = tmp_path / name
    path.mkdir(parents=True, exist_ok=True)
    (path / "ten.jsonl").write_text(TEN)
    return path


def rl_argv(tiny_sd3_dir: Path, *extra: str) -> list[str]:
    argv = ["train", "rl", "--recipe", "tiny-digits-grpo", "--hf-checkpoint", str(tiny_sd3_dir), *SMALL]
    return [*argv, "--eval-prompt-data", "d", "ten.jsonl", *extra]


def finish(proc: subprocess.Popen[str], timeout: float = 600) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def run_on_cluster(hosts: NetnsCluster, cwd: Path, argv: list[str], timeout: float = 600) -> tuple[int, str]:
    """The job's exit code and output; a failed job's output ends with what a reader of CI's log needs to tell
    why (the last lines of each actor's log, the machine's memory), its error line last."""
    rc, text = finish(hosts.driver(argv, cwd), timeout)
    return rc, (text if rc == 0 else text + diagnosis(cwd, text))


def diagnosis(cwd: Path, text: str, lines: int = 4) -> str:
    parts = ["", "--- diagnosis (tests/hosts/conftest.py) ---"]
    for log in sorted(cwd.rglob("logs/*.log")):
        tail = log.read_text(errors="replace").splitlines()[-lines:]
        parts += [f"{log.relative_to(cwd)}:", *(f"  {line[:200]}" for line in tail)]
    meminfo = Path("/proc/meminfo").read_text().splitlines()
    parts += [line for line in meminfo if line.startswith(("MemTotal", "MemAvailable"))]
    parts += [line for line in text.splitlines() if line.startswith("miles: error:")]
    return "\n".join(parts)


def run_one_host(cwd: Path, argv: list[str], timeout: float = 600) -> tuple[int, str]:
    """The same job on one host: a local Ray in this namespace (no RAY_ADDRESS), the same plan on CPU slots."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run(
        [sys.executable, "-m", "miles_cli", *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    return done.returncode, done.stdout + done.stderr


def metrics(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    timing = ("perf/", "time/")  # and every `*_time` (seconds measured, e.g. sync/write_time)
    return [{k: v for k, v in row.items() if not k.startswith(timing) and not k.endswith("_time")} for row in rows]


def actor_nodes(out: Path) -> dict[str, str]:
    """'role index' -> the node address each of the run's actors started on (its last start)."""
    nodes = {}
    for line in (out / "logs" / "actors.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("event") == "start":
            nodes[f"{record['role']} {record['index']}"] = record["node"]
    return nodes


def no_job_left(hosts: NetnsCluster, wait: float = 30.0) -> None:
    """Within `wait` seconds, no process of a job (actor, task, sglang server, driver) in any namespace."""
    deadline = time.monotonic() + wait
    left: dict[int, list] = {}
    while time.monotonic() < deadline:
        left = {i: hosts.job_processes(i) for i in range(len(hosts.hosts))}
        if not any(left.values()):
            return
        time.sleep(1.0)
    raise AssertionError(f"job processes left after {wait:.0f} s: {left}")
