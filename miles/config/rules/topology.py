"""Cluster topology, colocation and offload rules."""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles.config.resolution import Resolution

if TYPE_CHECKING:
    from miles.config.jobs import JobSpec


def train_world_size(res: Resolution) -> int:
    return res["actor_num_nodes"] * res["actor_num_gpus_per_node"]


def dp_size(res: Resolution) -> int:
    """Data-parallel ranks: the train world size divided by the sequence-parallel size."""
    return train_world_size(res) // res["sequence_parallel_size"]


def check_parallel_sizes(res: Resolution, job: JobSpec) -> None:
    world = train_world_size(res)
    sp = res["sequence_parallel_size"]
    if world % sp:
        res.fail(
            f"{res.show('sequence_parallel_size')} must divide the train world size "
            f"{world} (= {res.show('actor_num_nodes')} x {res.show('actor_num_gpus_per_node')})"
        )
    dp = world // sp
    if dp % res["dp_replicate_size"]:
        res.fail(f"{res.show('dp_replicate_size')} must divide dp_size {dp} (= train world size {world} / sp {sp})")
    ulysses = res["ulysses_degree"]
    if ulysses and sp % ulysses:
        res.fail(f"{res.show('ulysses_degree')} must divide {res.show('sequence_parallel_size')} (0 = auto)")
    if res["actor_num_gpus_per_node"] > res["num_gpus_per_node"] and res.explicit("num_gpus_per_node"):
        res.fail(
            f"{res.show('actor_num_gpus_per_node')} exceeds {res.show('num_gpus_per_node')}: "
            "a node cannot give the actor more GPUs than it has"
        )


def check_colocate(res: Resolution, job: JobSpec) -> None:
    world = train_world_size(res)
    if res["colocate"]:
        if res["rollout_num_gpus"] is None:
            res.derive("rollout_num_gpus", world)
        elif res["rollout_num_gpus"] != world:
            res.fail(
                f"{res.show('rollout_num_gpus')} contradicts {res.show('colocate')}, which forces it to the train "
                f"world size {world} (= {res.show('actor_num_nodes')} x {res.show('actor_num_gpus_per_node')})"
            )
        for dest in ("offload_train", "offload_rollout"):
            if res[dest] is False:
                res.fail(f"{res.show(dest)} contradicts {res.show('colocate')}, under which offload is always on")
            if res[dest] is None:
                res.derive(dest, True)
    if res["offload"]:
        for dest in ("offload_train", "offload_rollout"):
            if res[dest] is False:
                res.fail(f"{res.show(dest)} contradicts {res.show('offload')}, which turns on both")
            if res[dest] is None:
                res.derive(dest, True)
    if res["colocate_reward"] and not res["colocate"]:
        res.fail(f"{res.show('colocate_reward')} requires --colocate (reward actors share the rollout GPUs)")
    if res["lora_ipc_weight_sync"]:
        missing = [opt for opt, dest in (("--use-lora", "use_lora"), ("--colocate", "colocate")) if not res[dest]]
        if missing:
            res.fail(
                f"{res.show('lora_ipc_weight_sync')} requires {' and '.join(missing)} "
                "(CUDA IPC sync of lora_A/lora_B needs LoRA and colocated engines)"
            )


def check_rollout_gpus(res: Resolution, job: JobSpec) -> None:
    per_engine = res["rollout_num_gpus_per_engine"]
    total = res["rollout_num_gpus"]
    if total is not None and job.generates and total % per_engine:
        res.fail(
            f"{res.show('rollout_num_gpus')} must be a multiple of {res.show('rollout_num_gpus_per_engine')} "
            "(one engine per rollout_num_gpus_per_engine GPUs)"
        )


RULES = (check_parallel_sizes, check_colocate, check_rollout_gpus)
