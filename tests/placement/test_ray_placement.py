"""The shipped recipes' topologies on Ray clusters that declare GPUs this machine does not have.

Ray places every trainer rank, engine and reward worker exactly as on a GPU cluster (placement groups,
GPU ids, CUDA_VISIBLE_DEVICES) while each actor's torch sees no CUDA and computes on CPU. Each test runs
the job end to end through the CLI on the tiny model and reads `<output-dir>/placement.json`: what every
actor itself reported (Ray node, `ray.get_gpu_ids()`, device) against its slot of the plan.

The 2-GPU and 3-GPU topologies run in the default suite; the 8-GPU and 2-node x 4-GPU ones (marked
`cluster`, minutes each on 2 cores) run with `python -m pytest -m cluster tests/placement`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from miles.io.metrics import read_metrics
from miles_cli.main import main

pytestmark = pytest.mark.slow

SMALL = [
    "--rollout-batch-size", "2",
    "--n-samples-per-prompt", "4",
    "--rollout-microgroup-size", "4",
    "--micro-batch-size", "4",
    "--diffusion-num-steps", "4",
    "--diffusion-height", "64",
    "--diffusion-width", "64",
    "--diffusion-forward-dtype", "fp32",
    "--sglang-dit-precision", "fp32",
    "--num-rollout", "2",
]  # fmt: skip
TINY_DATA = ["--prompt-data", "digits:train", "--rm-type", "digit"]


def declared_gpus(nodes: int, gpus: int, cpus: int = 4) -> Any:
    """A Ray cluster of `nodes` nodes declaring `gpus` GPUs each (this machine has none)."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": cpus, "num_gpus": gpus})
    for _ in range(nodes - 1):
        cluster.add_node(num_cpus=cpus, num_gpus=gpus)
    cluster.wait_for_nodes()
    return cluster


@pytest.fixture
def gpu_cluster(monkeypatch: pytest.MonkeyPatch):
    """start(nodes, gpus): a fresh cluster for one test; RAY_ADDRESS points at it."""
    clusters: list[Any] = []

    def start(nodes: int, gpus: int, cpus: int = 4) -> Any:
        cluster = declared_gpus(nodes, gpus, cpus)
        monkeypatch.setenv("RAY_ADDRESS", cluster.address)
        clusters.append(cluster)
        return cluster

    yield start
    for cluster in clusters:
        cluster.shutdown()


def placed_as_planned(out: Path) -> dict[str, list[dict[str, Any]]]:
    """Every slot's actor sits on its planned node and holds its planned GPU ids; -> slots by role."""
    record = json.loads((out / "placement.json").read_text())
    assert record["gpu_mode"]
    by_role: dict[str, list[dict[str, Any]]] = {}
    physical: dict[tuple[str, int], int] = {}
    for slot in record["slots"]:
        seen = slot["observed"]
        assert seen is not None, slot
        assert seen["gpu_ids"] == slot["expected"]["gpu_ids"] and seen["gpu_ids"], slot
        assert seen["node_id"] == slot["expected"]["node_id"], slot
        assert seen["cuda_visible_devices"] == ",".join(map(str, seen["gpu_ids"])), slot
        assert seen["device"] == "cpu"  # torch sees no CUDA here
        for gpu, gpu_id in zip(slot["gpus"], slot["gpu_ids"], strict=True):
            assert physical.setdefault((seen["node_id"], gpu), gpu_id) == gpu_id  # one plan GPU, one device
        by_role.setdefault(slot["role"], []).append(slot)
    ids = list(physical)
    assert len({(node, physical[(node, gpu)]) for node, gpu in ids}) == len(ids)  # distinct plan GPUs differ
    return by_role


def shared_gpu(slots: dict[str, list[dict[str, Any]]], role: str, other: str) -> bool:
    """Slot i of `role` and slot i of `other` hold the same device."""
    return all(
        (a["observed"]["node_id"], a["gpu_ids"]) == (b["observed"]["node_id"], b["gpu_ids"])
        for a, b in zip(slots[role], slots[other], strict=True)
    )


def test_colocated_two_gpu_run_equals_the_plain_cpu_run(
    gpu_cluster, tiny_sd3_dir: Path, tmp_path: Path, small_digit_eval: list[str]
) -> None:
    """The sd3-ocr-grpo topology (2 ranks, 2 colocated engines, offload, in-place sync) on 2 declared GPUs
    gives the metrics of the same job run without --colocate (and so without offload) on plain CPU Ray."""
    common = ["train", "rl", "--recipe", "tiny-digits-grpo", "--hf-checkpoint", str(tiny_sd3_dir), *SMALL]
    common += ["--global-batch-size", "4", "--diffusion-num-sde-steps", "2", "--diffusion-sde-window-range", "0,4"]
    common += ["--actor-num-gpus-per-node", "2", *small_digit_eval]
    # each microgroup its own forward: the colocated engines (GPU mode: no thread hint) and the plain ones (their
    # node's cores) then run the same kernels, so the numbers agree to the bit; batched forwards split their
    # matmuls over however many threads each engine has
    common += ["--rollout-engine-batch-size", "2"]
    with pytest.MonkeyPatch.context() as patch:  # the plain run first: its local Ray, then the cluster's
        patch.delenv("RAY_ADDRESS", raising=False)
        assert main([*common, "--num-gpus-per-node", "3", "--output-dir", str(tmp_path / "plain")]) == 0
    gpu_cluster(1, 2)
    out = tmp_path / "colocated"
    assert main([*common, "--colocate", "--num-gpus-per-node", "2", "--output-dir", str(out)]) == 0
    slots = placed_as_planned(out)
    assert [s["share"] for s in slots["actor"]] == [0.7, 0.7] and [s["share"] for s in slots["engine"]] == [0.25] * 2
    assert shared_gpu(slots, "actor", "engine")
    colocated, plain = read_metrics(out / "metrics.jsonl"), read_metrics(tmp_path / "plain" / "metrics.jsonl")
    assert len(colocated) == len(plain) == 3  # two rollouts, then the eval set after the last (no --eval-interval)
    for a in colocated[:2]:
        assert a["perf/offload_train_bytes"] > 0 and a["perf/offload_rollout_bytes"] > 0
        assert a["sync/bytes_serialized"] < 20_000 < a["sync/bytes_by_handle"]  # handles, not weights
    for a, b in zip(colocated, plain, strict=True):
        keys = {k for k in b if not k.startswith(("perf/", "sync/"))}
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}
    assert colocated[2]["rollout_id"] == 2 and "eval/digits/accuracy" in colocated[2]


@pytest.mark.extended  # the 3-GPU plan is tested pure (tests/placement); Ray placement by the 2-GPU test above
def test_sd3_pickscore_nft_on_three_gpus(gpu_cluster, tiny_sd3_dir: Path, tiny_clip, tmp_path: Path) -> None:
    model, processor = tiny_clip
    eval_data = tmp_path / "eval.jsonl"
    eval_data.write_text("".join(json.dumps({"input": f"a handwritten digit {d}"}) + "\n" for d in range(4)))
    gpu_cluster(1, 3)
    out = tmp_path / "nft"
    argv = ["train", "rl", "--recipe", "sd3-pickscore-nft", "--hf-checkpoint", str(tiny_sd3_dir), *SMALL]
    argv += ["--prompt-data", "digits:train", "--global-batch-size", "8", "--lora-rank", "4", "--lora-alpha", "8"]
    argv += ["--pickscore-model-path", model, "--pickscore-processor-path", processor]
    argv += ["--eval-prompt-data", "small", str(eval_data), "--diffusion-eval-num-steps", "2"]
    assert main([*argv, "--output-dir", str(out)]) == 0
    slots = placed_as_planned(out)
    assert shared_gpu(slots, "actor", "engine")
    (reward,) = slots["reward"]
    assert reward["share"] == 1.0 and reward["gpus"] == [2]
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["rollout_id"] for r in rows if "rollout/reward/raw_mean" in r] == [0, 1]
    assert [r["rollout_id"] for r in rows if "eval/small/reward_mean" in r] == [0, 2]  # before training, at the end


@pytest.mark.cluster  # 24 actor processes: about 3 minutes on 2 cores
def test_sd35_4step_on_eight_gpus(gpu_cluster, tiny_sd3_dir: Path, tmp_path: Path) -> None:
    gpu_cluster(1, 8, cpus=8)
    out = tmp_path / "dmd2"
    argv = ["train", "dmd2", "--recipe", "sd35-4step", "--hf-checkpoint", str(tiny_sd3_dir)]
    argv += ["--prompt-data", "digits:train", "--rollout-batch-size", "8", "--global-batch-size", "8"]
    argv += ["--micro-batch-size", "1", "--num-rollout", "2", "--lora-rank", "4", "--lora-alpha", "4"]
    argv += ["--diffusion-height", "64", "--diffusion-width", "64", "--diffusion-forward-dtype", "fp32"]
    argv += ["--sglang-dit-precision", "fp32"]
    argv += ["--save", str(tmp_path / "ckpt"), "--output-dir", str(out)]
    assert main(argv) == 0
    slots = placed_as_planned(out)
    assert {role: len(v) for role, v in slots.items()} == {"actor": 8, "critic": 8, "engine": 8}
    assert shared_gpu(slots, "critic", "actor") and shared_gpu(slots, "actor", "engine")
    assert sorted(gpu for s in slots["engine"] for gpu in s["gpu_ids"]) == list(range(8))
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["rollout_id"] for r in rows] == [0, 1] and "train/loss" in rows[0]


@pytest.mark.cluster  # 12 actor processes over two nodes: about 1.5 minutes on 2 cores
def test_two_nodes_of_four_gpus(gpu_cluster, tiny_sd3_dir: Path, tmp_path: Path) -> None:
    gpu_cluster(2, 4)
    out = tmp_path / "multinode"
    argv = ["train", "rl", "--recipe", "sd3-ocr-grpo", "--hf-checkpoint", str(tiny_sd3_dir), *SMALL, *TINY_DATA]
    argv += ["--actor-num-nodes", "2", "--actor-num-gpus-per-node", "4", "--num-gpus-per-node", "4"]
    argv += ["--global-batch-size", "8", "--lora-rank", "4", "--lora-alpha", "8", "--output-dir", str(out)]
    argv += ["--diffusion-num-sde-steps", "2", "--diffusion-sde-window-range", "0,4"]
    argv += ["--rollout-num-gpus-per-engine", "2"]  # colocated engines over two GPUs each
    assert main(argv) == 0
    slots = placed_as_planned(out)
    nodes = [s["observed"]["node_id"] for s in slots["actor"]]
    assert len(set(nodes[:4])) == len(set(nodes[4:])) == 1 and nodes[0] != nodes[4]  # ranks 0-3, then 4-7
    for i, engine in enumerate(slots["engine"]):  # engine i on the GPUs of ranks 2i and 2i+1, Ray holding one
        ranks = slots["actor"][2 * i : 2 * i + 2]
        assert engine["gpu_ids"] == [r["gpu_ids"][0] for r in ranks]
        assert engine["observed"]["node_id"] == ranks[0]["observed"]["node_id"]
        assert engine["observed"]["gpu_ids"] == engine["gpu_ids"][:1]
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["rollout_id"] for r in rows] == [0, 1] and rows[1]["sync/engines"] == 4
