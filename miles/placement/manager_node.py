"""Where the rollout manager runs: `--rollout-manager-node` (`driver`, `head` or a node's IP address).

The manager holds the data source, the router and the supervision of the engines and reward workers; it is
placed on purpose, never wherever Ray has a free CPU, so that a setting does not work or fail by luck and the
host it needs is known (losing it ends the job). `describe()` is torch- and Ray-free (`miles plan`);
`find_node()` asks Ray (after `ray.init`).
"""

from __future__ import annotations

from typing import Any

from miles.core.errors import ConfigError

DRIVER = "driver"
HEAD = "head"


def setting(args: Any) -> str:
    return str(getattr(args, "rollout_manager_node", None) or DRIVER).strip()


def describe(args: Any, job: Any) -> str | None:
    """One line for the plan: where the manager will run (None for a job without one: its row of the job table,
    `miles.config.jobs.JobSpec`, starts no engines)."""
    if not job.starts_engines or getattr(args, "train_only", False) or getattr(args, "load_debug_rollout_data", None):
        return None
    where = setting(args)
    text = {DRIVER: "the node the command runs on", HEAD: "Ray's head node"}.get(where, f"the node at {where}")
    return f"rollout manager: {text} (--rollout-manager-node {where})"


def find_node(where: str) -> tuple[str, str]:
    """(Ray node id, address) of the alive node `where` names; one ConfigError when none does."""
    import ray

    alive = [n for n in ray.nodes() if n.get("Alive")]
    if where == DRIVER:
        node_id = ray.get_runtime_context().get_node_id()
        match = [n for n in alive if n["NodeID"] == node_id]
    elif where == HEAD:
        match = [n for n in alive if "node:__internal_head__" in n.get("Resources", {})]
    else:
        match = [n for n in alive if n.get("NodeManagerAddress") == where]
    if not match:
        known = ", ".join(sorted(str(n.get("NodeManagerAddress")) for n in alive)) or "none"
        raise ConfigError(
            f"--rollout-manager-node {where}: no alive Ray node is {where!r} (alive nodes: {known}); "
            "use driver, head or one of those addresses"
        )
    return str(match[0]["NodeID"]), str(match[0].get("NodeManagerAddress"))


def actor_options(node_id: str) -> dict[str, Any]:
    """Ray options that pin the manager to `node_id` (hard affinity: it never moves to another host)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {"num_cpus": 0, "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)}
