"""`<output-dir>/placement.json`: the plan, and where every actor really landed.

Written once the trainer groups, engines and reward workers are up. For each slot of the plan: its role,
index, node, GPUs and share, the Ray node and GPU ids Ray was asked for, and what the actor itself
reports (Ray node, `ray.get_gpu_ids()`, CUDA_VISIBLE_DEVICES, the torch device it computes on). A slot
whose actor sits elsewhere than planned is an error: the plan is what the job promised.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from miles.placement.ray_placement import RayPlacement
from miles.utils.atomic import atomic_write_text


def observed_placement(groups: list[Any], manager: Any) -> dict[tuple[str, int], dict[str, Any]]:
    """(role, index) -> what that actor reports of its placement."""
    import ray

    seen: dict[tuple[str, int], dict[str, Any]] = {}
    for group in groups:
        for slot, info in zip(group.slots, group.placement_info(), strict=True):
            seen[(group.role, slot.index)] = info
    if manager is not None:
        by_role = ray.get(manager.placement_info.remote())
        for role, infos in by_role.items():
            for index, info in enumerate(infos):
                seen[(role, index)] = info
    return seen


def record_placement(
    out: Path, placement: RayPlacement, groups: list[Any], manager: Any, manager_node: tuple[str, str] | None = None
) -> Path:
    """Check every actor against its slot and write `<out>/placement.json`; returns its path."""
    seen = observed_placement(groups, manager)
    slots = []
    wrong = []
    for slot in placement.plan.slots:
        expected = {"node_id": placement.node_id(slot), "gpu_ids": placement.ray_gpu_ids(slot)}
        observed = seen.get((slot.role, slot.index))
        if observed is not None and (
            observed["node_id"] != expected["node_id"] or observed["gpu_ids"] != expected["gpu_ids"]
        ):
            wrong.append(f"{slot.label}: planned {expected}, runs at {observed}")
        slots.append(
            {
                "role": slot.role,
                "index": slot.index,
                "node": slot.node,
                "gpus": list(slot.gpus),
                "share": slot.share,
                "gpu_ids": placement.gpu_ids(slot),
                "expected": expected,
                "observed": observed,
            }
        )
    path = out / "placement.json"
    record: dict[str, Any] = {"gpu_mode": placement.gpu_mode, "rows": placement.plan.rows(), "slots": slots}
    if manager_node is not None:
        record["rollout_manager"] = {"node_id": manager_node[0], "address": manager_node[1]}
    atomic_write_text(path, json.dumps(record, indent=2) + "\n")
    if wrong:
        raise RuntimeError("actors are not where the placement plan put them: " + "; ".join(wrong))
    return path
