"""Every job across hosts: each runs from host 0 (the driver, the rollout manager) with its trainer ranks and
engines on hosts 1 and 2, and gives what the same job gives on one host."""

from __future__ import annotations

from pathlib import Path

from conftest import SMALL, SPLIT, actor_nodes, metrics, no_job_left, rl_argv, run_on_cluster, run_one_host, workdir

H0, H1, H2 = "10.233.0.11", "10.233.0.12", "10.233.0.13"


def test_ranks_on_two_hosts_give_one_hosts_metrics_and_relative_paths_land_under_the_driver(
    hosts, tiny_sd3_dir: Path, tmp_path: Path
) -> None:
    cwd = workdir(tmp_path, "driver")
    argv = rl_argv(tiny_sd3_dir, *SPLIT, "--num-rollout", "2", "--output-dir", "out", "--save", "ckpt")
    rc, text = run_on_cluster(hosts, cwd, [*argv, "--save-interval", "1"])
    assert rc == 0, text[-4000:]
    nodes = actor_nodes(cwd / "out")
    assert nodes == {"actor 0": H1, "actor 1": H2, "engine 0": H1, "rollout_manager 0": H0}, nodes
    assert "rollout manager on node 10.233.0.11" in text
    # gloo found every rank by its node's own address, although here the hostname resolves to loopback
    import socket

    if socket.gethostbyname(socket.gethostname()).startswith("127."):
        assert "name resolves to 127." in text and "(loopback)" in text
    # relative --output-dir / --save / --eval-prompt-data: resolved in the driver's folder, not the raylets'
    assert (cwd / "out" / "checkpoint" / "model_index.json").is_file()
    assert (cwd / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    for host in hosts.hosts:
        assert not any(host.workdir.iterdir()), f"host {host.index}'s raylet folder got {list(host.workdir.iterdir())}"
    no_job_left(hosts)

    one = workdir(tmp_path, "one_host")
    rc, text = run_one_host(one, [*argv, "--save-interval", "1"])
    assert rc == 0, text[-4000:]
    assert metrics(cwd / "out") == metrics(one / "out")

    # the next job's --load ckpt (relative, again from the driver's folder) resumes
    rc, text = run_on_cluster(hosts, cwd, [*argv[:-6], "--num-rollout", "3", "--output-dir", "out", "--load", "ckpt"])
    assert rc == 0, text[-4000:]
    assert [row["rollout_id"] for row in metrics(cwd / "out") if "train/loss" in row] == [0, 1, 2]


def test_rollout_only_and_eval_with_the_engine_on_another_host(hosts, tiny_sd3_dir: Path, tmp_path: Path) -> None:
    cwd = workdir(tmp_path, "driver")
    small = [a for a in SMALL if a != "--deterministic-mode"]
    base = ["--recipe", "tiny-digits-grpo", "--hf-checkpoint", str(tiny_sd3_dir), *small]
    rc, text = run_on_cluster(hosts, cwd, ["rollout-only", *base, "--num-rollout", "1", "--output-dir", "ro"])
    assert rc == 0, text[-4000:]
    assert actor_nodes(cwd / "ro") == {"engine 0": H1, "rollout_manager 0": H0}
    assert (cwd / "ro" / "metrics.jsonl").is_file()
    evaluate = ["eval", *base, "--eval-prompt-data", "d", "ten.jsonl", "--output-dir", "ev"]
    rc, text = run_on_cluster(hosts, cwd, evaluate)
    assert rc == 0, text[-4000:]
    assert actor_nodes(cwd / "ev")["engine 0"] == H1
    assert any("eval/" in key for row in metrics(cwd / "ev") for key in row)
    no_job_left(hosts)


def test_a_reward_service_on_another_host(hosts, tiny_sd3_dir: Path, tmp_path: Path) -> None:
    """`miles reward serve` on host 2, bound to its own address; the job on hosts 0 and 1 scores through it."""
    import time

    cwd = workdir(tmp_path, "driver")
    ready = cwd / "reward.url"
    serve = ["reward", "serve", "--rm-type", "digit", "--hf-checkpoint", str(tiny_sd3_dir), "--host", H2]
    service = hosts.driver([*serve, "--port", "0", "--ready-file", str(ready)], cwd, host=2)
    try:
        deadline = time.monotonic() + 120
        while not ready.is_file():
            assert service.poll() is None and time.monotonic() < deadline, "the reward service did not start"
            time.sleep(0.2)
        url = ready.read_text().strip()
        assert url.startswith(f"http://{H2}:")
        argv = rl_argv(tiny_sd3_dir, "--num-rollout", "1", "--output-dir", "out", "--rm-type", "remote_rm")
        rc, text = run_on_cluster(hosts, cwd, [*argv, "--rm-url", url])
        assert rc == 0, text[-4000:]
        assert actor_nodes(cwd / "out")["rollout_manager 0"] == H0  # the job's reward calls crossed to host 2
        assert metrics(cwd / "out")[0]["rollout/reward/raw_mean"] >= 0.0
    finally:
        service.terminate()
        service.wait(timeout=30)
    no_job_left(hosts)
