"""Where a restarted engine actor goes: its own placement-group bundle while that bundle's node is alive, else
anywhere alive with the same resources (torch-free; Ray is imported when used).

An engine's options put it into a bundle of a placement group pinned to one node (`miles.placement`). When that
node is lost, the bundle cannot be scheduled again (the group is pinned by the node-id label), so an actor asked
into it would wait forever: the restart drops the bundle and asks Ray for the same GPUs and CPUs on any alive
node instead.
"""

from __future__ import annotations

import contextlib
from typing import Any


def alive_node_ids() -> set[str]:
    import ray

    return {str(node["NodeID"]) for node in ray.nodes() if node.get("Alive")}


def bundle_node(options: dict[str, Any]) -> tuple[bool, str | None]:
    """(whether `options` put the actor into a placement-group bundle, the node id that bundle is on: None when
    Ray no longer assigns it to a node, or the group is gone)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    strategy = options.get("scheduling_strategy")
    if not isinstance(strategy, PlacementGroupSchedulingStrategy) or strategy.placement_group is None:
        return False, None
    import ray.util

    table: dict[str, Any] = {}
    with contextlib.suppress(Exception):  # the group was removed: no node holds the bundle
        table = ray.util.placement_group_table(strategy.placement_group) or {}
    if str(table.get("state", "")).upper() == "REMOVED":
        return True, None
    nodes = table.get("bundles_to_node_id") or {}
    index = strategy.placement_group_bundle_index
    if index is None or index < 0:  # any bundle of the group: alive while one of them is
        alive = alive_node_ids()
        return True, next((str(n) for n in nodes.values() if str(n) in alive), None)
    node = nodes.get(index, nodes.get(str(index)))
    return True, None if node is None else str(node)


def anywhere_alive(options: dict[str, Any]) -> dict[str, Any]:
    """`options` without their placement: the same resources (GPUs, CPUs) on any alive node."""
    return {k: v for k, v in options.items() if k != "scheduling_strategy"}


def live_options(options: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """The options a restarted actor gets: `options` when their bundle's node is alive (or they name no bundle),
    else the same resources anywhere alive; with a note for the log when moved (else None)."""
    in_bundle, node = bundle_node(options)
    if not in_bundle:
        return options, None
    if node is not None and node in alive_node_ids():
        return options, None
    where = f"node {node[:12]}" if node else "its placement-group bundle's node"
    return anywhere_alive(options), f"{where} is gone: placed on any alive node with the same resources"
