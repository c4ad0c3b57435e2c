"""The reward service: rewards scored over HTTP (msgpack or JSON, PNG pixels; never pickle).

    protocol.py   the wire format (PROTOCOL_VERSION, encode_request / decode_request, ...)
    server.py     the aiohttp service: `make_app(scorers)`, `serve(settings, rm_types, host, port)`
    client.py     `RemoteRewardClient(url, reward, ...)`: batching, retries, waiting for a service that is down

Lightweight at import: the names below load their module on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "PROTOCOL_VERSION": "miles.rollout.rm_hub.service.protocol",
    "RemoteRewardClient": "miles.rollout.rm_hub.service.client",
    "make_app": "miles.rollout.rm_hub.service.server",
    "serve": "miles.rollout.rm_hub.service.server",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
