"""Cluster topology, colocation and offload."""

from __future__ import annotations

from miles.config.catalog._common import ENGINE_JOBS, LOOP_JOBS, flag_maker
from miles.config.flags import BOOL, FLOAT, INT, STR, TRISTATE, Flag

GROUP = "Cluster"
_f = flag_maker(GROUP)

FLAGS: list[Flag] = [
    _f("actor-num-nodes", INT, 1, "Number of nodes for the training actor.", min=1),
    _f(
        "actor-num-gpus-per-node",
        INT,
        8,
        "GPUs per training node; the train world size is nodes times this.",
        min=1,
    ),
    _f(
        "rollout-num-gpus",
        INT,
        None,
        "GPUs for rollout-side work; forced to the train world size under --colocate. For train-only SFT, "
        "leave unset to share the training GPUs with the encoders, or set it to reserve encoder GPUs.",
        min=1,
    ),
    _f(
        "rollout-num-gpus-per-engine",
        INT,
        1,
        "GPUs per rollout engine (its tensor x sequence parallel size).",
        min=1,
    ),
    _f(
        "num-gpus-per-node",
        INT,
        8,
        "GPUs the job may use on each node; set it when a node has fewer than 8.",
        min=1,
    ),
    _f(
        "gpu-memory-gib",
        FLOAT,
        None,
        "GPU memory (GiB) the memory plan checks each GPU's estimated peak against; a job over it is refused "
        "before launch with the changes that make it fit. Default: the smallest GPU nvidia-smi reports on this "
        "machine, else 80. 0 turns the check off.",
        min=0,
        meta={"default_text": "nvidia-smi's, else 80"},
    ),
    _f(
        "colocate",
        BOOL,
        False,
        "Put one engine on every --rollout-num-gpus-per-engine trainer GPUs (shares: trainer 0.7, engine 0.25); "
        "weight sync then passes tensor handles in place (CUDA IPC on GPUs, shared memory on CPU).",
        jobs=ENGINE_JOBS,
    ),
    _f(
        "offload",
        BOOL,
        False,
        "Shorthand for --offload-train plus --offload-rollout.",
        jobs=LOOP_JOBS,
    ),
    _f(
        "offload-train",
        TRISTATE,
        None,
        "Move the trainers' parameters, gradients and optimizer state off the device while the engines run; "
        "unset means on under --colocate, off otherwise.",
        meta={"default_text": "auto"},
        jobs=LOOP_JOBS,
    ),
    _f(
        "offload-rollout",
        TRISTATE,
        None,
        "Release the engines' weights while the trainers run; unset means on under --colocate, off otherwise.",
        meta={"default_text": "auto"},
        jobs=LOOP_JOBS,
    ),
    _f(
        "distributed-backend",
        STR,
        "nccl",
        "torch.distributed backend of the training process group on GPUs; a CPU-only rank uses "
        "--fsdp-cpu-backend (an explicit CUDA-only backend there is an error).",
    ),
    _f(
        "rollout-manager-node",
        STR,
        "driver",
        "Where the rollout manager runs (the data source, the router, the engines' and reward workers' "
        "supervision): `driver` (the node the command runs on), `head` (Ray's head node) or a node's IP address. "
        "Losing its node ends the job.",
        jobs=ENGINE_JOBS,
    ),
    _f(
        "host-timeout",
        FLOAT,
        30.0,
        "Seconds a host of the job may stay silent (its Ray node gone or unreachable) before the job ends "
        "naming it (or, under --use-fault-tolerance, re-places the engines it held); an actor cut off from the "
        "Ray head this long exits, so nothing of the job keeps running on a lost host.",
        min=3,
    ),
    _f(
        "distributed-timeout-minutes",
        INT,
        10,
        "Timeout, in minutes, for collective operations of the training process group.",
        min=1,
    ),
]
