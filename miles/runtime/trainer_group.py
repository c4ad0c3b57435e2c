"""A trainer group: the ranks of one trainer role (`actor`, or DMD2's `critic`) as Ray actors.

Each rank sits in the bundle its slot of the placement plan names (`miles.placement`), with its share of
that GPU (0.7 next to an engine under --colocate, 0.35 each for DMD2's critic and actor, ...); the ranks
form one torch process group (rank 0's node hosts the rendezvous). A rank picks its device from what its
own torch sees (a GPU if CUDA is visible to it, else CPU), never from the driver's view.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import ray

from miles.placement.ray_placement import RayPlacement, actor_placement_info
from miles.utils.actors import owned_remote, tag_for
from miles.utils.torch_threads import thread_options_here


def _free_port() -> tuple[str, int]:
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return ray.util.get_node_ip_address(), port


def rendezvous(placement: RayPlacement, first: Any) -> tuple[str, int]:
    """The address and a free port of rank 0's node for the ranks' process group: found here when rank 0 is on
    the driver's node, else by a task in rank 0's bundle (a worker process to start: about 1 s)."""
    if placement.node_id(first) == ray.get_runtime_context().get_node_id():
        return _free_port()
    options = placement.options(first)
    task = ray.remote(_free_port).options(num_cpus=0, scheduling_strategy=options["scheduling_strategy"])
    return ray.get(task.remote())


def train_threads(args: Any, world: int) -> int:
    """A rank's torch threads: `OMP_NUM_THREADS` when `--train-env-vars` sets it (Ray sets its own in every
    actor, so only the flag's value counts), else this node's cores shared among the ranks. On a machine whose
    cores other work shares, fewer threads than cores avoids the OpenMP spin of oversubscription."""
    value = (args.train_env_vars or {}).get("OMP_NUM_THREADS")
    if value is not None and str(value).isdigit() and int(value) > 0:
        return int(value)
    return max(1, (os.cpu_count() or 1) // max(1, world))


def use_node_interface(args: Any) -> str | None:
    """Point gloo at the interface that carries this node's Ray address (GLOO_SOCKET_IFNAME), unless
    `--train-env-vars` (or the environment) names one. Without it gloo takes its address from the hostname, which
    resolves to loopback on many images: ranks on other hosts are then told to connect to 127.0.0.1. The interface
    set, or None (left as it was, or no interface has the address)."""
    if (args.train_env_vars or {}).get("GLOO_SOCKET_IFNAME") or os.environ.get("GLOO_SOCKET_IFNAME"):
        return None
    from miles.utils.net import interface_for

    name = interface_for(ray.util.get_node_ip_address())
    if name is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = name
    return name


class TrainerActor:
    """One rank: a `miles.training.trainer.Trainer` inside a Ray actor."""

    def __init__(
        self, args: Any, rank: int, world: int, addr: str, port: int, total_steps: int, across_hosts: bool = False
    ) -> None:

        from miles.training.trainer import Trainer
        from miles.utils.torch_threads import use_threads

        if across_hosts:
            use_node_interface(args)
        use_threads(train_threads(args, world))
        self.trainer = Trainer(args, rank, world, addr, port, total_steps)

    def ready(self) -> bool:
        return True

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def placement_info(self) -> dict[str, Any]:
        """Where this rank runs: Ray node, the GPU ids Ray gave it, CUDA_VISIBLE_DEVICES, the torch device."""
        return actor_placement_info(str(next(self.trainer.model.parameters()).device))

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

    def sync_in_place(self, engines: list[Any], version: int) -> dict[str, float]:
        return self.trainer.sync_in_place(engines, version)


class TrainerGroup:
    """The ranks of `role`, placed by `placement` (made for the job when not given: tests and benches)."""

    def __init__(self, args: Any, role: str, total_steps: int, placement: RayPlacement | None = None) -> None:
        self.role = role
        self.owns_placement = placement is None
        if placement is None:
            from miles.config.jobs import job_spec
            from miles.placement.ray_placement import place

            placement = place(args, job_spec(args.job))
        self.placement = placement
        self.slots = placement.slots(role)
        self.world = len(self.slots)
        expected = int(args.actor_num_nodes) * int(args.actor_num_gpus_per_node)
        if self.world != expected:
            raise ValueError(f"the placement plan has {self.world} {role} ranks, the args ask for {expected}")
        addr, port = rendezvous(placement, self.slots[0])
        # ranks on several Ray nodes: each rank's gloo uses its node's own interface (`use_node_interface`)
        across = len({placement.node_id(slot) for slot in self.slots}) > 1
        actor_cls = owned_remote(TrainerActor)
        # a rank on the driver's own node starts with its torch threads (`miles.utils.torch_threads`)
        threads = train_threads(args, self.world)
        self.actors = [
            actor_cls.options(
                **placement.options(slot), **thread_options_here(placement.node_id(slot), threads)
            ).remote(
                args,
                slot.index,
                self.world,
                addr,
                port,
                total_steps,
                across,
                _miles_tag=tag_for(args, role, slot.index),
            )
            for slot in self.slots
        ]
        ray.get([a.ready.remote() for a in self.actors])

    def _all(self, method: str, *args: Any) -> list[Any]:
        return ray.get([getattr(a, method).remote(*args) for a in self.actors])

    def train(self, rollout_id: int, samples: Any) -> dict[str, float]:
        """One rollout's training on every rank: `samples` is a list, or a reference to one in Ray's object store
        (`RolloutBatch.trainer_input`: the manager put it there, the driver never fetched it)."""
        from miles.core.packed import Packed

        ref = samples if isinstance(samples, ray.ObjectRef) else ray.put(Packed(samples))  # once for every rank
        return self._all("train", rollout_id, ref)[0]

    def train_sft(self, x0: Any, samples: list[Any]) -> dict[str, float]:
        from miles.core.packed import Packed

        return self._all("train_sft", ray.put(x0), ray.put(Packed(samples)))[0]

    def engine_weights(self) -> dict[str, Any]:
        """Every rank joins the all-gather; rank 0's copy is returned."""
        return self._all("engine_weights")[0]

    def weights_for_sync(self) -> dict[str, Any]:
        """What a sync pushes (only the LoRA tensors under --lora-ipc-weight-sync); rank 0's copy."""
        return self._all("weights_for_sync")[0]

    def call(self, method: str, *args: Any) -> list[Any]:
        return ray.get([a.call.remote(method, *args) for a in self.actors])

    def placement_info(self) -> list[dict[str, Any]]:
        return ray.get([a.placement_info.remote() for a in self.actors])

    def offload(self, parts: tuple[str, ...] = ("optimizer", "grads", "params")) -> float:
        """Every rank moves `parts` off its device (`Trainer.offload`); bytes moved by the group."""
        return sum(r["bytes"] for r in self.call("offload", parts))

    def onload(self) -> float:
        return sum(r["bytes"] for r in self.call("onload"))

    def shutdown(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
        if self.owns_placement:
            self.placement.shutdown()

    def sync_in_place(self, engines: list[Any], version: int) -> dict[str, float]:
        """--colocate: every rank joins the gather and rank i * --rollout-num-gpus-per-engine passes engine
        i (`engines`, in order) the weights by handle; the first feeding rank's metrics (tensors, bytes by
        handle, bytes of handles sent, seconds) plus `sync/engines`."""
        results = self._all("sync_in_place", engines, version)
        fed = [r for r in results if r]
        if len(fed) != len(engines):
            raise RuntimeError(
                f"in-place weight sync fed {len(fed)} of {len(engines)} engines: under --colocate engine i takes "
                f"the weights from trainer rank i * --rollout-num-gpus-per-engine, and there are {self.world} ranks"
            )
        metrics = dict(fed[0]) if fed else {}
        metrics["sync/engines"] = float(len(fed))
        return metrics
