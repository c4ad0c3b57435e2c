"""A trainer group: `actor_num_nodes x actor_num_gpus_per_node` Trainer ranks as Ray actors.

Ranks are placed with a Ray placement group (one bundle per rank: one GPU where the cluster has
GPUs, else one CPU slot) and form one torch process group (nccl on GPUs, gloo on CPU; on a CPU
machine a "GPU" of the topology flags is one rank). Rank 0's node hosts the rendezvous.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


def _free_port() -> tuple[str, int]:
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return ray.util.get_node_ip_address(), port


class TrainerActor:
    """One rank: a `miles.training.trainer.Trainer` inside a Ray actor."""

    def __init__(self, args: Any, rank: int, world: int, addr: str, port: int, total_steps: int) -> None:
        import torch

        from miles.training.trainer import Trainer

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, world)))
        self.trainer = Trainer(args, rank, world, addr, port, total_steps)

    def ready(self) -> bool:
        return True

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def train(self, rollout_id: int, samples: list[Any]) -> dict[str, float]:
        return self.trainer.train(rollout_id, samples)

    def train_sft(self, x0: Any, samples: list[Any]) -> dict[str, float]:
        return self.trainer.train_sft(x0, samples)

    def engine_weights(self) -> dict[str, Any]:
        return self.trainer.engine_weights()

    def weights_for_sync(self) -> dict[str, Any]:
        return self.trainer.weights_for_sync()

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.trainer, method)(*args, **kwargs)


class TrainerGroup:
    """`colocate_with`: place this group's ranks in another group's bundles (rank i next to its rank i),
    each rank taking `share` of a bundle's CPU/GPU; the first group of a colocated set passes the same share."""

    def __init__(
        self,
        args: Any,
        role: str,
        total_steps: int,
        colocate_with: TrainerGroup | None = None,
        share: float = 1.0,
    ) -> None:
        import torch

        self.role = role
        self.world = int(args.actor_num_nodes) * int(args.actor_num_gpus_per_node)
        gpus = 1 if torch.cuda.is_available() else 0
        if colocate_with is not None:
            if colocate_with.world != self.world:
                raise ValueError(
                    f"trainer group {role!r} has {self.world} ranks but colocates with "
                    f"{colocate_with.role!r}, which has {colocate_with.world}"
                )
            self.pg = colocate_with.pg
        else:
            bundle = {"GPU": gpus, "CPU": 1} if gpus else {"CPU": 1}
            self.pg = placement_group([dict(bundle) for _ in range(self.world)], strategy="PACK")
            ray.get(self.pg.ready())
        self.owns_pg = colocate_with is None
        strategy = [
            PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i) for i in range(self.world)
        ]
        addr, port = ray.get(ray.remote(_free_port).options(num_cpus=0, scheduling_strategy=strategy[0]).remote())
        actor_cls = ray.remote(TrainerActor)
        self.actors = [
            actor_cls.options(num_cpus=share, num_gpus=gpus * share, scheduling_strategy=strategy[i]).remote(
                args, i, self.world, addr, port, total_steps
            )
            for i in range(self.world)
        ]
        ray.get([a.ready.remote() for a in self.actors])

    def _all(self, method: str, *args: Any) -> list[Any]:
        return ray.get([getattr(a, method).remote(*args) for a in self.actors])

    def train(self, rollout_id: int, samples: list[Any]) -> dict[str, float]:
        ref = ray.put(samples)
        return self._all("train", rollout_id, ref)[0]

    def train_sft(self, x0: Any, samples: list[Any]) -> dict[str, float]:
        return self._all("train_sft", ray.put(x0), ray.put(samples))[0]

    def engine_weights(self) -> dict[str, Any]:
        """Every rank joins the all-gather; rank 0's copy is returned."""
        return self._all("engine_weights")[0]

    def weights_for_sync(self) -> dict[str, Any]:
        """What a sync pushes (only the LoRA tensors under --lora-ipc-weight-sync); rank 0's copy."""
        return self._all("weights_for_sync")[0]

    def call(self, method: str, *args: Any) -> list[Any]:
        return ray.get([a.call.remote(method, *args) for a in self.actors])

    def shutdown(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
        if self.owns_pg:
            ray.util.remove_placement_group(self.pg)
