"""Where a restarted engine actor goes: its own placement-group bundle while that bundle's node is alive, else
anywhere alive with the same resources (torch-free; Ray is imported when used).

An engine's options put it into a bundle of a placement group pinned to one node (`miles.placement`). When that
node is lost, the bundle cannot be scheduled again (the group is pinned by the node-id label), so an actor asked
into it would wait forever: the restart drops the bundle and asks Ray for the same GPUs and CPUs on any alive
node instead.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
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


NODE_DEATH_WAIT_S = 15.0  # how long a bundle's node may take to be declared dead after an actor in it died


def _node_goes(options: dict[str, Any], wait: float, poll: float) -> bool:
    """Whether the node of `options`' bundle is (or within `wait` seconds is declared) dead."""
    deadline = time.monotonic() + wait
    while True:
        if live_options(options)[1] is not None:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(poll)


def start_placed(
    options: dict[str, Any],
    make: Callable[[dict[str, Any]], Any],
    first_answer: Callable[[Any], Any],
    timeout: float | None = None,
    poll: float = 1.0,
) -> tuple[Any, Any, str | None]:
    """Start a restarted actor (`make(options)`) and wait for `first_answer(actor)` (an ObjectRef): in its bundle
    while the bundle's node lives, else anywhere alive. A node can die after the actor was asked into its bundle
    (the actor's death is often known before the node's), so while the answer is pending the node is looked at
    again, and the actor started elsewhere once the node is gone. Returns (actor, its answer, a note when moved);
    an error of the actor's start is raised as Ray raises it; `timeout` (seconds, None: no limit) raises
    TimeoutError."""
    import ray

    from miles.rollout.engines.failure_text import constructor_failed

    current, moved = live_options(options)
    actor = make(current)
    ref = first_answer(actor)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        ready, _ = ray.wait([ref], timeout=poll)
        if ready:
            try:
                return actor, ray.get(ref), moved
            except ray.exceptions.RayActorError as exc:
                # died in its bundle: when that is because the bundle's node is dying (Ray learns of the node's
                # death a few seconds after its actors'), start it again anywhere alive; else the error stands (a
                # constructor that raised is the engine's own failure, said at once)
                if constructor_failed(exc) or moved is not None or not _node_goes(options, NODE_DEATH_WAIT_S, poll):
                    raise
                current, moved = live_options(options)
                actor = make(current)
                ref = first_answer(actor)
                continue
        if moved is None:
            current, moved = live_options(options)
            if moved is not None:  # the bundle's node died while the actor waited for it
                with contextlib.suppress(Exception):
                    ray.kill(actor, no_restart=True)
                actor = make(current)
                ref = first_answer(actor)
        if deadline is not None and time.monotonic() > deadline:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
            raise TimeoutError(f"the actor did not start within {timeout:g} s")
