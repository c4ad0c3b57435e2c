"""Trainer ranks placed across nodes: Ray's simulated 2-node cluster, FSDP2 over gloo between them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miles.config.resolve import resolve

pytestmark = pytest.mark.slow


def test_two_nodes_one_rank_each_train_in_one_process_group(tiny_sd3_dir: Path) -> None:
    import ray
    from ray.cluster_utils import Cluster

    from miles.rollout.manager import RolloutManager
    from miles.runtime.trainer_group import TrainerGroup

    cli = {
        "hf_checkpoint": str(tiny_sd3_dir),
        "actor_num_nodes": 2,
        "actor_num_gpus_per_node": 1,
        "rollout_batch_size": 2,
        "n_samples_per_prompt": 4,
        "global_batch_size": 8,
        "micro_batch_size": 4,
        "diffusion_num_steps": 4,
        "diffusion_num_sde_steps": 2,
        "diffusion_sde_window_range": "0,4",
        "lr": 1e-3,
    }
    args = resolve("rl", recipe="tiny-digits-grpo", cli=cli).args
    samples = RolloutManager(args).generate(0).samples
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    try:
        ray.init(address=cluster.address, include_dashboard=False)
        group = TrainerGroup(args, "actor", total_steps=4)
        nodes = ray.get([actor.node_id.remote() for actor in group.actors])
        assert len(set(nodes)) == 2  # one rank per node
        metrics = group.train(0, samples)
        assert metrics["grad_norm"] > 0
        weights = ray.get([actor.engine_weights.remote() for actor in group.actors])
        assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])  # one model, two shards
    finally:
        ray.shutdown()
        cluster.shutdown()
