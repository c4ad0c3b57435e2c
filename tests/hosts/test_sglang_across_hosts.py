"""An sglang engine on another host than the router: the server binds and advertises its node's own address
(`--rollout-engine-host auto`), the router on the driver's host reaches it, every sync is verified on the server
by digest, and the training rollouts give the one-host run's metrics."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import SPLIT, actor_nodes, metrics, no_job_left, rl_argv, run_on_cluster, run_one_host, workdir

from miles.utils.sglang_env import resolve_sglang_python

H0, H1, H2 = "10.233.0.11", "10.233.0.12", "10.233.0.13"

pytestmark = pytest.mark.skipif(
    resolve_sglang_python(None) is None, reason="no sglang environment (bash scripts/build_sglang_env.sh)"
)


def test_an_sglang_engine_on_another_host_than_the_router(hosts, tiny_sd3_dir: Path, tmp_path: Path) -> None:
    argv = rl_argv(tiny_sd3_dir, *SPLIT, "--rollout-backend", "sglang", "--num-rollout", "2", "--output-dir", "out")
    cwd = workdir(tmp_path, "driver")
    rc, text = run_on_cluster(hosts, cwd, argv, timeout=900)
    assert rc == 0, text[-4000:]
    nodes = actor_nodes(cwd / "out")
    assert nodes["engine 0"] == H1 and nodes["rollout_manager 0"] == H0
    assert {nodes["actor 0"], nodes["actor 1"]} == {H1, H2}
    engine_log = (cwd / "out" / "logs" / "engine-0.log").read_text()
    assert f"http://{H1}:" in engine_log or f"http://{H1}:" in text  # advertised by its node's address
    rows = [row for row in metrics(cwd / "out") if "train/loss" in row]
    # the sync before rollout 1 reached the server on host 1 and was checked there, tensor by tensor
    assert rows[1]["sync/verified_tensors"] > 0 and rows[1]["sync/engines_agree"] == 1.0
    no_job_left(hosts)

    one = workdir(tmp_path, "one_host")
    rc, text = run_one_host(one, argv, timeout=900)
    assert rc == 0, text[-4000:]
    assert metrics(cwd / "out") == metrics(one / "out")
