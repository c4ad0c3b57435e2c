"""A trainer rank's parallel layout: its process-group backend, the FSDP2 mesh (HSDP) and its sequence-parallel group.

Ranks are laid out as [dp_replicate, dp_shard, sp] (the last dimension fastest):

- a sequence-parallel (SP) group is `--sequence-parallel-size` consecutive ranks; its ranks get the same
  data, so the data is split over dp_size = world / sp groups (dp rank = rank // sp);
- FSDP2 shards the parameters over the dp_shard x sp ranks of each replica: a 1-D mesh over the world
  with `--dp-replicate-size 1` (today's FSDP), else the 2-D mesh (dp_replicate, dp_shard) of shape
  (R, world / R) (HSDP: reduce-scatter within a replica, all-reduce across replicas).

FSDP2 averages gradients over all of its mesh's ranks. With SP every rank of a group computes the whole
loss, and the SP collectives' backwards are exact adjoints, so the group's gradients sum to sp times the
group loss's gradient; averaging over world = dp x sp ranks then gives exactly the gradient of the mean
loss over the dp groups, the plain data-parallel gradient (tests/training/test_parallel.py checks it).

Every group is created with `--distributed-timeout-minutes` (torch's `new_group` would otherwise give it
the 30-minute default).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from miles.config.args import DEFAULT
from miles.config.backends import ATTENTION_BACKENDS, DEVICE_WORDS, DISTRIBUTED_BACKENDS, attention_backends_on_cpu
from miles.core.errors import ConfigError


def timeout_of(args: Any) -> timedelta:
    return timedelta(minutes=args.distributed_timeout_minutes)


def _source(args: Any, name: str) -> str:
    source_of = getattr(args, "source_of", None)
    return source_of(name) if source_of is not None else DEFAULT


def process_group_backend(args: Any, cuda: bool) -> str:
    """The backend of this rank's process group, decided by what the rank has (`cuda`: a CUDA device).

    With CUDA: `--distributed-backend` (nccl), under `--fsdp-cpu-offload` the hybrid
    `cpu:<--fsdp-cpu-backend>,cuda:<--distributed-backend>`. Without: `--fsdp-cpu-backend` (gloo); the
    default `--distributed-backend nccl` then means it, while an explicit backend that cannot run on the
    CPU, or one that contradicts `--fsdp-cpu-backend`, is refused.
    """
    backend, cpu_backend = args.distributed_backend, args.fsdp_cpu_backend
    if cuda:
        return f"cpu:{cpu_backend},cuda:{backend}" if args.fsdp_cpu_offload else backend
    source = _source(args, "distributed_backend")
    if source == DEFAULT:
        return cpu_backend
    devices = DISTRIBUTED_BACKENDS.get(backend, ())
    if "cpu" not in devices:
        needs = " or ".join(DEVICE_WORDS.get(d, d) for d in devices) or "a device this rank lacks"
        raise ConfigError(
            f"--distributed-backend {backend} ({source}) needs {needs}, and this trainer rank has none; use "
            f"--distributed-backend {cpu_backend} (a CPU-only rank's process group runs on --fsdp-cpu-backend)"
        )
    if backend != cpu_backend:
        raise ConfigError(
            f"--distributed-backend {backend} ({source}) contradicts --fsdp-cpu-backend {cpu_backend} "
            f"({_source(args, 'fsdp_cpu_backend')}) on this CPU-only trainer rank, whose one process group "
            "uses --fsdp-cpu-backend; set them alike"
        )
    return cpu_backend


def check_attention_backend_device(name: str, cuda: bool) -> None:
    """Refuse an attention backend that needs a device this rank does not have."""
    device = ATTENTION_BACKENDS.get(name)
    if device is None:
        return
    if not (cuda if device == "cuda" else _has_device(device)):
        raise ConfigError(
            f"--fsdp-attention-backend {name} needs {DEVICE_WORDS.get(device, device)}, and this trainer rank "
            f"has none; on the CPU use one of {', '.join(attention_backends_on_cpu())}"
        )


def _has_device(device: str) -> bool:
    import torch

    module = getattr(torch, device, None)
    return bool(module is not None and getattr(module, "is_available", lambda: False)())


@dataclass(frozen=True)
class ParallelLayout:
    """This rank's place in the layout. `mesh` is None for FSDP2's default 1-D mesh over the world;
    `sp_group` is None without sequence parallelism."""

    rank: int
    world: int
    sp_size: int
    replicate: int
    sp_group: Any = None
    mesh: Any = None

    @property
    def dp_size(self) -> int:
        return self.world // self.sp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.sp_size

    @property
    def sp_rank(self) -> int:
        return self.rank % self.sp_size


def check_sizes(world: int, sp: int, replicate: int) -> None:
    """The layout exists for `world` ranks (the config rules check the same from the topology flags)."""
    if world % sp:
        raise ConfigError(f"--sequence-parallel-size {sp} must divide the train world size {world}")
    if (world // sp) % replicate:
        raise ConfigError(
            f"--dp-replicate-size {replicate} must divide dp_size {world // sp} (= train world size {world} / sp {sp})"
        )


def build_layout(args: Any, rank: int, world: int) -> ParallelLayout:
    """Create this rank's groups (collective: every rank of the world calls it with the same args)."""
    sp, replicate = args.sequence_parallel_size, args.dp_replicate_size
    check_sizes(world, sp, replicate)
    sp_group = _sp_group(rank, world, sp, timeout_of(args)) if sp > 1 else None
    mesh = _hsdp_mesh(rank, world, replicate, timeout_of(args)) if replicate > 1 else None
    return ParallelLayout(rank, world, sp, replicate, sp_group, mesh)


def _sp_group(rank: int, world: int, sp: int, timeout: timedelta) -> Any:
    import torch.distributed as dist

    blocks = [list(range(start, start + sp)) for start in range(0, world, sp)]
    mine, _ = dist.new_subgroups_by_enumeration(blocks, timeout=timeout)
    return mine


def _hsdp_mesh(rank: int, world: int, replicate: int, timeout: timedelta) -> Any:
    """The 2-D mesh (dp_replicate, dp_shard) of shape (R, world / R) built from groups that carry `timeout`."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    grid = torch.arange(world).reshape(replicate, world // replicate)
    replicas, _ = dist.new_subgroups_by_enumeration(grid.T.tolist(), timeout=timeout)  # one per shard index
    shards, _ = dist.new_subgroups_by_enumeration(grid.tolist(), timeout=timeout)  # one per replica
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return DeviceMesh.from_group([replicas, shards], device, mesh=grid, mesh_dim_names=("dp_replicate", "dp_shard"))
