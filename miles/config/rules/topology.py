"""Cluster topology, colocation and offload rules."""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles.config.resolution import Resolution

if TYPE_CHECKING:
    from miles.config.jobs import JobSpec


def train_world_size(res: Resolution) -> int:
    return res["actor_num_nodes"] * res["actor_num_gpus_per_node"]


def dp_size(res: Resolution) -> int:
    """Data-parallel ranks, as the trainer splits the data (`miles.training.parallel.ParallelLayout`).

    The train world is cut into groups of `--sequence-parallel-size` consecutive ranks; the ranks of one
    group share the same pairs (each holds a slice of every sample's image tokens), so the data is split
    over world / sp groups. HSDP does not change it: `--dp-replicate-size` R groups x dp_shard
    (= dp / R) groups are all data-parallel. FSDP2 shards the parameters over the dp_shard x sp ranks of
    each replica (mesh (R, world / R)).
    """
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
    if ulysses and sp // ulysses > 1:
        res.fail(
            f"{res.show('sequence_parallel_size')} with {res.show('ulysses_degree')} needs ring attention "
            f"(ring degree {sp // ulysses}), which miles' trainer does not have; set --ulysses-degree {sp} "
            "or 0 (Ulysses fills the sequence-parallel size)"
        )
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
    if job.trains_on_dataset and res.source("rollout_num_gpus") == "cli":
        res.fail(
            f"{res.show('rollout_num_gpus')}: `miles {job.command}` encodes its data set once, before training, "
            "in the job's own process, so there are no encoder GPUs to reserve; drop the flag"
        )
    per_engine = res["rollout_num_gpus_per_engine"]
    engines = res["rollout_num_engines"]
    if engines is not None:
        if res["rollout_num_gpus"] is None:
            res.derive("rollout_num_gpus", engines * per_engine)
        elif engines * per_engine != res["rollout_num_gpus"]:
            res.fail(
                f"{res.show('rollout_num_engines')} x {res.show('rollout_num_gpus_per_engine')} contradicts "
                f"{res.show('rollout_num_gpus')}"
            )
    total = res["rollout_num_gpus"]
    if total is not None and job.generates and total % per_engine:
        res.fail(
            f"{res.show('rollout_num_gpus')} must be a multiple of {res.show('rollout_num_gpus_per_engine')} "
            "(one engine per rollout_num_gpus_per_engine GPUs)"
        )


def check_placement(res: Resolution, job: JobSpec) -> None:
    """The placement plan on the cluster the flags describe: a layout that cannot exist on any cluster (an
    engine across nodes, ...) is refused here, before Ray starts. Runs after every other rule."""
    from miles.placement.cluster import flags_cluster
    from miles.placement.plan import make_plan

    args = res.to_args()
    make_plan(args, flags_cluster(args), job)


RULES = (check_parallel_sizes, check_colocate, check_rollout_gpus)
