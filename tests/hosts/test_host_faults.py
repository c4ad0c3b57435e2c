"""Host faults: a host's processes killed, its link down, its link slowed, an engine-only host lost under fault
tolerance. A lost host ends the job within --host-timeout (8 s here) plus at most the `miles` command's 15 s
grace, in one line naming it, with nothing of the job left running in any namespace; a resumed run gives the
unfaulted run's metrics; a slowed link changes nothing but time; a lost engine is re-placed on a live host."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from conftest import SPLIT, actor_nodes, finish, metrics, no_job_left, rl_argv, run_on_cluster, workdir
from netns_cluster import netem_available

H1, H2 = "10.233.0.12", "10.233.0.13"
BOUND = 8 + 15 + 10  # --host-timeout, the miles command's 15 s grace, and the exit on this slow machine


@pytest.fixture(scope="module")
def unfaulted(hosts, tiny_sd3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    cwd = workdir(tmp_path_factory.mktemp("unfaulted"), "driver")
    rc, text = run_on_cluster(hosts, cwd, rl_argv(tiny_sd3_dir, *SPLIT, "--num-rollout", "3", "--output-dir", "out"))
    assert rc == 0, text[-4000:]
    return metrics(cwd / "out")


def _wait_for(path: Path, text: str, proc, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not (path.is_file() and path.read_text().strip() == text):
        assert proc.poll() is None, "the job ended before the fault"
        assert time.monotonic() < deadline, f"{path} never read {text}"
        time.sleep(0.2)


def _ends_naming(proc, address: str, since: float) -> str:
    rc, text = finish(proc, timeout=120)
    took = time.monotonic() - since
    assert rc == 1, text[-4000:]
    errors = [line for line in text.splitlines() if line.startswith("miles: error:")]
    assert len(errors) == 1 and f"host {address} lost" in errors[0], errors or text[-3000:]
    assert took < BOUND, f"the job took {took:.1f} s to end after the fault"
    return errors[0]


def test_a_killed_host_ends_the_job_naming_it_and_a_resume_gives_the_unfaulted_metrics(
    healthy, unfaulted: list[dict], tiny_sd3_dir: Path, tmp_path: Path
) -> None:
    cwd = workdir(tmp_path, "driver")
    argv = rl_argv(tiny_sd3_dir, *SPLIT, "--output-dir", "out", "--save", "ckpt", "--save-interval", "1")
    proc = healthy.driver([*argv, "--num-rollout", "3"], cwd)
    _wait_for(cwd / "ckpt" / "latest_checkpointed_iteration.txt", "0", proc)
    since = time.monotonic()
    healthy.kill_host(2)
    line = _ends_naming(proc, H2, since)
    assert "actor 1" in line and "last complete checkpoint" in line
    assert actor_nodes(cwd / "out")["actor 1"] == H2
    no_job_left(healthy)
    healthy.heal(2)
    rc, text = run_on_cluster(healthy, cwd, [*argv, "--num-rollout", "3", "--load", "ckpt"])
    assert rc == 0, text[-4000:]
    resumed = [row for row in metrics(cwd / "out") if "train/loss" in row]
    assert resumed[-1]["rollout_id"] == 2
    assert resumed[-1] == [row for row in unfaulted if "train/loss" in row][-1]


def test_a_host_whose_link_goes_down_ends_the_job_and_its_actors_exit(
    healthy, tiny_sd3_dir: Path, tmp_path: Path
) -> None:
    cwd = workdir(tmp_path, "driver")
    proc = healthy.driver(rl_argv(tiny_sd3_dir, *SPLIT, "--num-rollout", "20", "--output-dir", "out"), cwd)
    deadline = time.monotonic() + 300
    while not ((cwd / "out" / "metrics.jsonl").is_file() and (cwd / "out" / "metrics.jsonl").read_text().strip()):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.2)
    since = time.monotonic()
    healthy.link(2, up=False)
    _ends_naming(proc, H2, since)
    # the cut-off host's actors (a trainer rank, its probe) end themselves after --host-timeout
    no_job_left(healthy, wait=20)


def test_a_slowed_link_changes_nothing_but_time(
    healthy, unfaulted: list[dict], tiny_sd3_dir: Path, tmp_path: Path
) -> None:
    cwd = workdir(tmp_path, "driver")
    # a token bucket at 20 Mbit/s on host 2's link (the weights, the gathers and the samples all cross it)
    healthy.shape(2, ["tbf", "rate", "20mbit", "burst", "64kb", "latency", "200ms"])
    rc, text = run_on_cluster(healthy, cwd, rl_argv(tiny_sd3_dir, *SPLIT, "--num-rollout", "3", "--output-dir", "out"))
    assert rc == 0, text[-4000:]
    assert actor_nodes(cwd / "out")["actor 1"] == H2  # its gathers crossed the slowed link
    assert metrics(cwd / "out") == unfaulted


def test_a_lossy_delayed_link_changes_nothing_but_time(
    healthy, unfaulted: list[dict], tiny_sd3_dir: Path, tmp_path: Path
) -> None:
    reason = netem_available()
    if reason:
        pytest.skip(reason)
    cwd = workdir(tmp_path, "driver")
    healthy.shape(2, ["netem", "delay", "20ms", "5ms", "loss", "1%"])
    rc, text = run_on_cluster(healthy, cwd, rl_argv(tiny_sd3_dir, *SPLIT, "--num-rollout", "3", "--output-dir", "out"))
    assert rc == 0, text[-4000:]
    assert metrics(cwd / "out") == unfaulted


def test_an_engine_only_host_lost_under_fault_tolerance_is_re_placed(
    healthy, tiny_sd3_dir: Path, tmp_path: Path
) -> None:
    """Both ranks on host 1, the engine alone on host 2: host 2 dies, the engine restarts on host 1's free GPU
    with the synced weights, and the job completes."""
    cwd = workdir(tmp_path, "driver")
    ranks = ["--actor-num-nodes", "1", "--actor-num-gpus-per-node", "2", "--use-fault-tolerance"]
    argv = rl_argv(tiny_sd3_dir, *ranks, "--num-rollout", "4", "--output-dir", "out")
    proc = healthy.driver(argv, cwd)
    deadline = time.monotonic() + 300
    while not ((cwd / "out" / "metrics.jsonl").is_file() and (cwd / "out" / "metrics.jsonl").read_text().strip()):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.2)
    assert actor_nodes(cwd / "out")["engine 0"] == H2
    healthy.kill_host(2)
    rc, text = finish(proc, timeout=400)
    assert rc == 0, text[-4000:]
    assert f"host {H2} lost" in text
    assert actor_nodes(cwd / "out")["engine 0"] == H1  # its restart
    assert [row["rollout_id"] for row in metrics(cwd / "out") if "train/loss" in row] == [0, 1, 2, 3]
    no_job_left(healthy)
