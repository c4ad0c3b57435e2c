"""Who sends the rollout's HTTP POSTs to the sglang engines (through the miles router).

    LocalPoster        one aiohttp session in the rollout's own event loop (the default)
    DistributedPoster  --use-distributed-post: Ray actors on every alive node of the cluster,
                       $MILES_HTTP_POST_ACTORS_PER_NODE per node (default 1), each with its own aiohttp
                       session; requests go to them round-robin (node by node), so the sending and the
                       receiving of large bodies is spread over the cluster's nodes instead of one process

Both answer `post(url, payload)` with the same `PostReply` (status, body bytes, the engine that answered),
so the caller cannot tell them apart except by who opened the connection. The actors live as long as the
job (not detached): `DistributedPoster.shutdown` ends them, and Ray ends them with the job.
A poster actor sends `User-Agent: miles-http-poster node=<node id> pid=<pid>`.

Torch-free; ray and aiohttp are imported only when used.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from typing import Any

from miles.utils.sglang_env import actors_per_node


@dataclass(frozen=True)
class PostReply:
    status: int
    body: bytes
    engine: str | None  # the engine that answered (the router's X-Miles-Engine header), when named


async def _post(session: Any, url: str, payload: dict[str, Any]) -> PostReply:
    from miles.rollout.engines.sglang.router import ENGINE_HEADER

    async with session.post(url, json=payload) as resp:
        body = await resp.read()
        return PostReply(resp.status, body, resp.headers.get(ENGINE_HEADER))


def _session(headers: dict[str, str] | None = None) -> Any:
    import aiohttp

    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=None), connector=aiohttp.TCPConnector(limit=0), headers=headers
    )


class LocalPoster:
    """POSTs from this process: one session per use (`async with poster:`), in the caller's event loop."""

    def __init__(self) -> None:
        self._session: Any = None

    async def __aenter__(self) -> LocalPoster:
        self._session = _session()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._session.close()
        self._session = None

    async def post(self, url: str, payload: dict[str, Any]) -> PostReply:
        return await _post(self._session, url, payload)

    def shutdown(self) -> None:
        pass


class HttpPosterActor:
    """One poster (an async Ray actor): POSTs with its own aiohttp session, created in its event loop."""

    def __init__(self) -> None:
        import ray

        self.node_id = ray.get_runtime_context().get_node_id()
        self.pid = os.getpid()
        self.posts = 0
        self._session: Any = None

    async def post(self, url: str, payload: dict[str, Any]) -> PostReply:
        if self._session is None:
            self._session = _session({"User-Agent": f"miles-http-poster node={self.node_id} pid={self.pid}"})
        self.posts += 1
        return await _post(self._session, url, payload)

    async def info(self) -> dict[str, Any]:
        return {"node_id": self.node_id, "pid": self.pid, "posts": self.posts}


class DistributedPoster:
    """`per_node` poster actors pinned to each alive node (zero CPUs: they wait on sockets); `post` awaits the
    next one in round-robin order."""

    def __init__(self, per_node: int | None = None, max_concurrency: int = 1000) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        per_node = actors_per_node() if per_node is None else int(per_node)
        nodes = sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))
        actor = ray.remote(HttpPosterActor)
        self.actors = [
            actor.options(
                num_cpus=0,
                max_concurrency=max_concurrency,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False),
            ).remote()
            for _ in range(per_node)
            for node in nodes  # node by node within each round, so consecutive requests leave from different nodes
        ]
        self._next = itertools.cycle(range(len(self.actors)))
        ray.get([a.info.remote() for a in self.actors])  # started (a placement failure surfaces here)

    async def __aenter__(self) -> DistributedPoster:
        return self

    async def __aexit__(self, *exc: object) -> None:
        pass

    async def post(self, url: str, payload: dict[str, Any]) -> PostReply:
        return await self.actors[next(self._next)].post.remote(url, payload)

    def info(self) -> list[dict[str, Any]]:
        """Per actor, in round-robin order: node id, pid and the number of POSTs it sent."""
        import ray

        return ray.get([a.info.remote() for a in self.actors])

    def shutdown(self) -> None:
        import contextlib

        import ray

        for a in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(a)
        self.actors = []


def make_poster(args: Any, max_concurrency: int = 1000) -> LocalPoster | DistributedPoster:
    """The poster `args` ask for (--use-distributed-post)."""
    if args.use_distributed_post:
        return DistributedPoster(max_concurrency=max_concurrency)
    return LocalPoster()
