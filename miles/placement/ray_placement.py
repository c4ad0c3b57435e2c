"""A placement plan made real on Ray, before any trainer rank, engine or reward worker starts.

One STRICT_PACK placement group per node of the plan, pinned to its Ray node by the node-id label, with
one bundle per planned GPU (`{"GPU": 1}`), or one bundle for all the GPUs of a slot that owns several
(a non-colocated multi-GPU engine). A probe task per bundle reads the physical GPU ids Ray gave it, so
every slot knows its GPUs before its actor starts; an actor is then scheduled into its bundle asking for
its share (`num_gpus=0.7` for a colocated trainer rank, ...), and Ray sets its CUDA_VISIBLE_DEVICES.

On a cluster without GPUs (a laptop, CI) the plan is made on the cluster the flags describe and every
"GPU" of it is a CPU bundle: the same actors, the same layout, tensors on CPU. A cluster that declares
GPUs the machine lacks (`ray start --num-gpus`, `ray.cluster_utils.Cluster`) places exactly as a GPU
cluster would while the actors' torch, seeing no CUDA, computes on CPU: that is how the tests verify it.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any

from miles.core.errors import ConfigError
from miles.placement.cluster import ClusterSpec, NodeSpec
from miles.placement.plan import Plan, Slot

# CPU reserved per bundle: nominal, so that CPU-only actors (OCR workers, parsers) never wait behind GPU bundles.
CPU_PER_BUNDLE = 0.01
READY_TIMEOUT_S = float(os.environ.get("MILES_PLACEMENT_TIMEOUT", "120"))


@dataclass(frozen=True)
class _Bundle:
    node: int
    index: int  # bundle index in the node's placement group
    gpus: tuple[int, ...]  # plan GPUs held by the bundle


class RayPlacement:
    """Placement groups for `plan` and each slot's Ray options. Picklable: actors that start other actors
    (the rollout manager starts the engines and reward workers) receive it."""

    def __init__(self, plan: Plan, ray_nodes: tuple[NodeSpec, ...], gpu_mode: bool) -> None:
        from ray.util.placement_group import placement_group

        self.plan = plan
        self.gpu_mode = gpu_mode
        self.bundles: dict[tuple[int, int], _Bundle] = {}  # (node, plan gpu) -> bundle
        self.physical: dict[tuple[int, int], int] = {}  # (node, plan gpu) -> Ray's GPU id on the node
        self.groups: dict[int, Any] = {}
        self.ray_node_ids: dict[int, str] = {}
        if not ray_nodes:
            raise ConfigError("placement: Ray reports no alive node")
        try:
            for k in range(len(plan.nodes)):
                units = _units(plan, k)
                if not units:
                    continue
                node_id = plan.nodes[k].node_id if gpu_mode else ray_nodes[k % len(ray_nodes)].node_id
                assert node_id is not None
                shapes = [
                    {"GPU": float(len(u)), "CPU": CPU_PER_BUNDLE} if gpu_mode else {"CPU": CPU_PER_BUNDLE}
                    for u in units
                ]
                group = placement_group(
                    shapes,
                    strategy="STRICT_PACK",
                    bundle_label_selector=[{"ray.io/node-id": node_id}] * len(units),
                )
                self.groups[k] = group
                self.ray_node_ids[k] = node_id
                for i, unit in enumerate(units):
                    for gpu in unit:
                        self.bundles[(k, gpu)] = _Bundle(k, i, unit)
            self._wait_ready()
            if gpu_mode:
                self._probe_gpu_ids()
        except BaseException:
            self.shutdown()
            raise

    # ---- set-up ----------------------------------------------------------------------------------
    def _wait_ready(self) -> None:
        import ray

        refs = {k: group.ready() for k, group in self.groups.items()}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=READY_TIMEOUT_S)
        late = [k for k, ref in refs.items() if ref not in ready]
        if late:
            want = {k: sum(1 for (node, _) in self.bundles if node == k) for k in late}
            free = ray.available_resources().get("GPU", 0.0)
            raise ConfigError(
                "placement: Ray could not reserve "
                + ", ".join(f"{want[k]} GPU(s) on plan node {k}" for k in late)
                + f" within {READY_TIMEOUT_S:.0f} s (the cluster has {free:g} GPUs free now; other jobs may hold "
                "the rest). Free them, or plan for what is free with `miles plan --cluster NxG`."
            )

    def _probe_gpu_ids(self) -> None:
        """Ask every bundle which GPU ids Ray gave it; plan GPUs of single-GPU bundles follow id order."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        probe = ray.remote(_gpu_ids)
        for k, group in self.groups.items():
            units = sorted({b for b in self.bundles.values() if b.node == k}, key=lambda b: b.index)
            ids = ray.get(
                [
                    probe.options(
                        num_cpus=0,
                        num_gpus=float(len(b.gpus)),
                        scheduling_strategy=PlacementGroupSchedulingStrategy(group, b.index),
                    ).remote()
                    for b in units
                ]
            )
            singles = sorted((found[0], b) for b, found in zip(units, ids, strict=True) if len(b.gpus) == 1)
            plan_singles = sorted(b.gpus[0] for b in units if len(b.gpus) == 1)
            for plan_gpu, (gpu_id, bundle) in zip(plan_singles, singles, strict=True):
                self.bundles[(k, plan_gpu)] = _Bundle(k, bundle.index, (plan_gpu,))
                self.physical[(k, plan_gpu)] = gpu_id
            for b, found in zip(units, ids, strict=True):
                if len(b.gpus) > 1:
                    for plan_gpu, gpu_id in zip(b.gpus, sorted(found), strict=True):
                        self.physical[(k, plan_gpu)] = gpu_id

    # ---- what actors use -------------------------------------------------------------------------
    def slots(self, role: str) -> list[Slot]:
        return self.plan.slots_of(role)

    def options(self, slot: Slot) -> dict[str, Any]:
        """Ray actor options that put `slot`'s actor into its bundle with its share."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = self.bundles[(slot.node, slot.gpus[0])]
        owns_bundle = len(bundle.gpus) > 1  # a multi-GPU bundle belongs to one slot
        share = 1.0 if owns_bundle else slot.share
        num_gpus = float(len(bundle.gpus)) if owns_bundle else slot.share
        return {
            "scheduling_strategy": PlacementGroupSchedulingStrategy(self.groups[slot.node], bundle.index),
            "num_gpus": round(num_gpus, 4) if self.gpu_mode else 0,
            "num_cpus": max(0.0001, round(CPU_PER_BUNDLE * share, 4)),
        }

    def gpu_ids(self, slot: Slot) -> list[int]:
        """The physical GPU ids (Ray's, on the slot's node) of all the slot's GPUs; [] on a CPU cluster."""
        if not self.gpu_mode:
            return []
        return [self.physical[(slot.node, gpu)] for gpu in slot.gpus]

    def ray_gpu_ids(self, slot: Slot) -> list[int]:
        """What `ray.get_gpu_ids()` reports inside the slot's actor: all of a bundle it owns, else the one
        GPU of its bundle (a colocated engine over several GPUs holds a share of its first one; its server
        is pinned to all of `gpu_ids`)."""
        if not self.gpu_mode:
            return []
        bundle = self.bundles[(slot.node, slot.gpus[0])]
        return sorted(self.physical[(slot.node, gpu)] for gpu in bundle.gpus)

    def node_id(self, slot: Slot) -> str:
        return self.ray_node_ids[slot.node]

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        if not ray.is_initialized():
            return
        for group in self.groups.values():
            with contextlib.suppress(Exception):  # already gone with its job
                remove_placement_group(group)
        self.groups = {}


def actor_placement_info(device: str) -> dict[str, Any]:
    """What an actor sees of its placement (call it inside the actor): its Ray node, the GPU ids Ray gave
    it, its CUDA_VISIBLE_DEVICES and the torch device it computes on."""
    import ray

    return {
        "node_id": ray.get_runtime_context().get_node_id(),
        "gpu_ids": [int(g) for g in ray.get_gpu_ids()],
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "device": device,
    }


def _gpu_ids() -> list[int]:
    import ray

    return [int(g) for g in ray.get_gpu_ids()]


def _units(plan: Plan, k: int) -> list[tuple[int, ...]]:
    """The bundles of node k: one per planned GPU, except that a slot owning several GPUs gets one bundle."""
    taken: set[int] = set()
    units: list[tuple[int, ...]] = []
    for slot in sorted((s for s in plan.slots if s.node == k), key=lambda s: s.gpus):
        if len(slot.gpus) > 1 and slot.share >= 1.0 and not taken & set(slot.gpus):
            units.append(slot.gpus)
            taken.update(slot.gpus)
    for gpu in sorted({g for s in plan.slots if s.node == k for g in s.gpus} - taken):
        units.append((gpu,))
    return sorted(units)


def place(args: Any, job: Any) -> RayPlacement:
    """Plan `job` (`miles.config.jobs.job_spec(args.job)`) on the Ray cluster it is connected to (after `ray.init`)
    and reserve its bundles.

    With no GPU in the cluster the plan is made on the cluster the flags describe and realized on CPU.
    """
    from miles.placement.cluster import flags_cluster, ray_cluster
    from miles.placement.plan import make_plan

    cluster = ray_cluster()
    gpu_mode = any(node.gpus for node in cluster.nodes)
    plan_on: ClusterSpec = cluster if gpu_mode else flags_cluster(args)
    plan = make_plan(args, plan_on, job)
    return RayPlacement(plan, cluster.nodes, gpu_mode)
