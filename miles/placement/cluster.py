"""The cluster a plan is made for: `--cluster NxG`, the cluster the flags describe, or Ray's view.

Torch-free; only `ray_cluster()` imports Ray (and only when called).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from miles.core.errors import ConfigError


@dataclass(frozen=True)
class NodeSpec:
    """One node: its GPUs and CPUs (None: unknown), and Ray's node id and address when it is a Ray node."""

    gpus: int
    cpus: float | None = None
    node_id: str | None = None
    address: str | None = None


@dataclass(frozen=True)
class ClusterSpec:
    """The nodes a plan may use. `elastic`: nodes of `gpus_per_node` GPUs are added as the plan needs them
    (the cluster the flags describe). `simulated`: Ray declares GPUs that the actors' torch cannot see."""

    nodes: tuple[NodeSpec, ...]
    source: str
    elastic: bool = False
    gpus_per_node: int = 0

    @property
    def has_gpus(self) -> bool:
        return self.elastic or any(n.gpus > 0 for n in self.nodes)

    def describe(self, nodes: tuple[NodeSpec, ...] | None = None) -> str:
        """'1 node x 8 GPUs (Ray's cluster)': the shape of `nodes` (default: this cluster's) and the source."""
        nodes = self.nodes if nodes is None else nodes
        return f"{shape(nodes)} ({self.source})"


def shape(nodes: tuple[NodeSpec, ...]) -> str:
    counts = sorted({n.gpus for n in nodes})
    if not nodes:
        return "no node"
    if len(counts) == 1:
        return f"{len(nodes)} node{'s' if len(nodes) != 1 else ''} x {counts[0]} GPUs"
    return f"{len(nodes)} nodes with " + ", ".join(str(n.gpus) for n in nodes) + " GPUs"


_CLUSTER = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*$")


MAX_NODES = 4096  # far past any real job; the plan lists every node, so the bound keeps `miles plan` instant
MAX_GPUS_PER_NODE = 64


def parse_cluster(text: str) -> ClusterSpec:
    """`--cluster NxG`: N nodes with G GPUs each (CPUs unknown)."""
    match = _CLUSTER.match(text)
    if not match or int(match.group(1)) < 1:
        raise ConfigError(f"--cluster {text}: expected NODESxGPUS, e.g. 2x8 (2 nodes with 8 GPUs each)")
    nodes, gpus = int(match.group(1)), int(match.group(2))
    if nodes > MAX_NODES or gpus > MAX_GPUS_PER_NODE:
        raise ConfigError(
            f"--cluster {text}: at most {MAX_NODES} nodes of {MAX_GPUS_PER_NODE} GPUs each can be planned"
        )
    return ClusterSpec(tuple(NodeSpec(gpus=gpus) for _ in range(nodes)), source=f"--cluster {nodes}x{gpus}")


def flags_cluster(args: Any) -> ClusterSpec:
    """The cluster the job's own flags describe: as many nodes of --num-gpus-per-node GPUs as it needs."""
    per_node = int(args.num_gpus_per_node)
    return ClusterSpec(
        (),
        source=f"the cluster the flags describe, --num-gpus-per-node {per_node}",
        elastic=True,
        gpus_per_node=per_node,
    )


def ray_cluster() -> ClusterSpec:
    """Ray's view of the cluster it is connected to (call after `ray.init`): the alive nodes, head first.

    With GPUs anywhere, only the nodes that have GPUs can hold a slot of the plan (a CPU-only head node of
    a GPU cluster holds none); with no GPU at all it is a CPU cluster (see `miles.placement.plan`).
    """
    import ray

    nodes = []
    for info in ray.nodes():
        if not info.get("Alive"):
            continue
        resources = info.get("Resources", {})
        nodes.append(
            (
                "node:__internal_head__" not in resources,
                info.get("NodeManagerAddress", ""),
                info["NodeID"],
                NodeSpec(
                    gpus=int(resources.get("GPU", 0)),
                    cpus=float(resources.get("CPU", 0)),
                    node_id=info["NodeID"],
                    address=info.get("NodeManagerAddress"),
                ),
            )
        )
    specs = [spec for *_, spec in sorted(nodes, key=lambda item: item[:3])]
    if any(spec.gpus for spec in specs):
        specs = [spec for spec in specs if spec.gpus]
    return ClusterSpec(tuple(specs), source="Ray's cluster")
