"""Host addresses of the servers miles starts (torch-free, Ray-free).

A server binds one address and tells the others another one, its *advertised* address:

    bind                      advertised
    loopback (127.0.0.1, ::1, localhost)   itself: reachable from its own host only
    wildcard (0.0.0.0, ::, "")             the node's own IP (0.0.0.0 is nobody's address)
    any other address                      itself

`resolve_bind_host` reads `--rollout-engine-host`: "auto" binds the node's own IP when the Ray cluster has more
than one alive node (the others must reach it), else 127.0.0.1; any other value is the bind address.
`interface_for(ip)` names the network interface that carries an IPv4 address (for GLOO_SOCKET_IFNAME).
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket

AUTO = "auto"
LOOPBACK_V4 = "127.0.0.1"
_LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})
_WILDCARDS = frozenset({"", "0.0.0.0", "::", "*"})


def _bare(host: str) -> str:
    """`host` without surrounding spaces and IPv6 brackets, lower-cased."""
    text = host.strip().lower()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    return text


def _address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(_bare(host))
    except ValueError:
        return None


def is_wildcard(host: str) -> bool:
    """A bind to every interface of the host: "0.0.0.0", "::" or "" (nobody can be told to connect there)."""
    return _bare(host) in _WILDCARDS


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or a loopback name such as "localhost": reachable from its own host only."""
    bare = _bare(host)
    if bare in _LOOPBACK_NAMES:
        return True
    address = _address(bare)
    return address is not None and address.is_loopback


def advertised_host(bind_host: str, node_ip: str) -> str:
    """The address the other processes (and hosts) should use for a server bound to `bind_host` on the node
    whose IP is `node_ip`: a loopback bind stays itself, a wildcard bind is the node's IP, any other address is
    itself."""
    if is_wildcard(bind_host):
        return node_ip
    return _bare(bind_host) if _address(bind_host) is not None else bind_host.strip()


def local_host(bind_host: str) -> str:
    """Where a process on the server's own host reaches a server bound to `bind_host` (a wildcard bind: the
    loopback address of its family)."""
    bare = _bare(bind_host)
    if bare == "::":
        return "::1"
    if is_wildcard(bare):
        return LOOPBACK_V4
    return bare if _address(bare) is not None else bind_host.strip()


def resolve_bind_host(setting: str | None, node_ip: str, alive_nodes: int) -> str:
    """The address a server binds for `--rollout-engine-host` `setting` on the node whose IP is `node_ip`: "auto"
    (or unset) binds the node's IP when the cluster has more than one alive node, else 127.0.0.1; anything else is
    the bind address itself."""
    text = (setting or AUTO).strip()
    if text.lower() == AUTO:
        return node_ip if alive_nodes > 1 else LOOPBACK_V4
    return text


def url_host(host: str) -> str:
    """`host` as it is written in a URL (an IPv6 literal in brackets)."""
    bare = _bare(host)
    address = _address(bare)
    if address is not None and address.version == 6:
        return f"[{bare}]"
    return host.strip()


def http_url(host: str, port: int) -> str:
    return f"http://{url_host(host)}:{int(port)}"


def host_of(url: str) -> str:
    """The host of `http://host:port[/...]` (an IPv6 literal without its brackets)."""
    rest = url.split("://", 1)[-1].split("/", 1)[0]
    if rest.startswith("["):
        return rest[1 : rest.index("]")]
    return rest.rsplit(":", 1)[0] if ":" in rest else rest


def primary_ip() -> str:
    """This host's IP on the route out (no packet is sent); 127.0.0.1 when there is no route. Outside Ray only:
    inside it the node's address is `ray.util.get_node_ip_address()`."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect(("192.0.2.1", 9))  # TEST-NET-1: a route lookup only, UDP sends nothing on connect
        return str(sock.getsockname()[0])
    return LOOPBACK_V4


def interface_for(ip: str) -> str | None:
    """The name of the network interface carrying IPv4 address `ip` on this host (e.g. "eth0"); None when no
    interface has it."""
    import psutil

    wanted = _bare(ip)
    for name, addresses in psutil.net_if_addrs().items():
        for entry in addresses:
            if entry.family == socket.AF_INET and entry.address == wanted:
                return name
    return None
