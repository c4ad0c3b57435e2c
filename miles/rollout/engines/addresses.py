"""Where the sglang servers and the miles router listen, and what they tell the others (torch-free).

`serving_address(setting)` is computed by the process that starts the server, on its own node: the engine actor
for its sglang server, the rollout manager for the router. "auto" (the default of `--rollout-engine-host`) binds
the node's Ray address when the cluster has more than one alive node, else 127.0.0.1; any other value is the bind
address. The advertised address is the one other hosts use (the node's IP for a wildcard bind), see
`miles.utils.net`. Outside Ray (tests, benches) the cluster is this one host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from miles.core.errors import ConfigError
from miles.utils.net import (
    AUTO,
    advertised_host,
    http_url,
    is_loopback,
    local_host,
    primary_ip,
    resolve_bind_host,
)

FLAG = "--rollout-engine-host"


@dataclass(frozen=True)
class ServingAddress:
    bind: str  # what the server binds
    advertised: str  # what the other processes and hosts are told
    local: str  # where a process on the server's own host reaches it
    node_ip: str  # the node's own address (Ray's)

    def url(self, port: int) -> str:
        """The advertised URL of a server on `port`."""
        return http_url(self.advertised, port)

    def local_url(self, port: int) -> str:
        return http_url(self.local, port)


def _ray() -> Any:
    try:
        import ray
    except ImportError:  # pragma: no cover - Ray is a dependency of every job that starts a server
        return None
    initialized = getattr(ray, "is_initialized", None)
    return ray if initialized is not None and initialized() else None


def node_ip() -> str:
    """This process's node address as Ray knows it (outside Ray: the host's address on its route out)."""
    ray = _ray()
    if ray is None:
        return primary_ip()
    import ray.util

    return str(ray.util.get_node_ip_address())


def node_id() -> str | None:
    """This process's Ray node id (None outside Ray)."""
    ray = _ray()
    if ray is None:
        return None
    return str(ray.get_runtime_context().get_node_id())


def alive_nodes() -> int:
    """How many nodes of the Ray cluster are alive (1 outside Ray)."""
    ray = _ray()
    if ray is None:
        return 1
    return sum(1 for node in ray.nodes() if node.get("Alive"))


def serving_address(setting: str | None) -> ServingAddress:
    """The bind, advertised and local addresses of a server this process starts, for `--rollout-engine-host`
    `setting`."""
    ip = node_ip()
    explicit = (setting or AUTO).strip().lower() != AUTO
    bind = resolve_bind_host(setting, ip, 1 if explicit else alive_nodes())
    return ServingAddress(bind=bind, advertised=advertised_host(bind, ip), local=local_host(bind), node_ip=ip)


def explicit_loopback(setting: str | None) -> bool:
    """`--rollout-engine-host` asks for a loopback bind by name (not "auto")."""
    text = (setting or AUTO).strip()
    return text.lower() != AUTO and is_loopback(text)


def loopback_across_nodes(setting: str | None, what: str, node: str, router_node: str) -> ConfigError:
    """The one-line error of an explicit loopback bind while `what` runs on another node than the router."""
    return loopback_refused(setting, f"{what} runs on node {node} but the miles router on node {router_node}")


def loopback_refused(setting: str | None, why: str) -> ConfigError:
    return ConfigError(
        f"{FLAG} {setting}: {why}, and a loopback address is reachable from its own host only; use {FLAG} auto "
        "(each node's own address) or 0.0.0.0, or keep the engines on the router's node"
    )
