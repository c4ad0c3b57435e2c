"""--use-distributed-post: rollout POSTs sent by per-node Ray poster actors instead of the local client.

A real local Ray and a real HTTP server (aiohttp, in a thread) that answers every POST with a body computed
from the payload and records who sent it (the poster actors' User-Agent names their pid). Directly and
through the miles router, the actors' replies are byte for byte the local client's; the server saw the
POSTs come from $MILES_HTTP_POST_ACTORS_PER_NODE actors, dealt round-robin.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp import web

from miles.config.resolution import schema_args
from miles.rollout.engines.sglang.posting import DistributedPoster, LocalPoster, PostReply, make_poster
from miles.rollout.engines.sglang.router import MilesRouter, RouterConfig
from miles.utils.sglang_env import ACTORS_PER_NODE_VAR

PATH = "/rollout/generate"


class EchoServer:
    """POST /rollout/generate -> a JSON body derived from the payload; GET /health -> 200."""

    def __init__(self) -> None:
        self.agents: list[str] = []
        self.loop = asyncio.new_event_loop()
        self.url = ""
        ready = threading.Event()
        self.thread = threading.Thread(target=self._main, args=(ready,), daemon=True)
        self.thread.start()
        assert ready.wait(10), "echo server did not start"

    def _main(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_post(PATH, self._generate)
        app.router.add_get("/health", self._health)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        ready.set()
        self.loop.run_forever()

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _generate(self, request: web.Request) -> web.Response:
        payload = await request.json()
        self.agents.append(request.headers.get("User-Agent", ""))
        body = {"prompt": payload["prompt"], "seed": payload["seed"], "doubled": [2 * v for v in payload["values"]]}
        return web.Response(body=json.dumps(body, sort_keys=True).encode(), content_type="application/json")

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def echo() -> Iterator[EchoServer]:
    server = EchoServer()
    yield server
    server.stop()


PAYLOADS = [{"prompt": f"digit {i}", "seed": 100 + i, "values": list(range(i + 1))} for i in range(7)]


def post_all(poster: Any, url: str) -> list[PostReply]:
    async def go() -> list[PostReply]:
        async with poster as client:
            return list(await asyncio.gather(*(client.post(url, p) for p in PAYLOADS)))

    return asyncio.run(go())


def poster_pid(agent: str) -> int | None:
    match = re.fullmatch(r"miles-http-poster node=\w+ pid=(\d+)", agent)
    return int(match.group(1)) if match else None


@pytest.mark.slow
def test_posts_go_through_the_poster_actors_and_answer_as_the_local_client(
    local_ray: Any, echo: EchoServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ACTORS_PER_NODE_VAR, "3")
    poster = make_poster(schema_args(use_distributed_post=True))
    assert isinstance(poster, DistributedPoster)
    assert isinstance(make_poster(schema_args(use_distributed_post=False)), LocalPoster)
    try:
        nodes = [n["NodeID"] for n in local_ray.nodes() if n["Alive"]]
        info = poster.info()
        assert len(info) == 3 * len(nodes)
        assert Counter(i["node_id"] for i in info) == dict.fromkeys(nodes, 3)
        pids = [i["pid"] for i in info]
        assert len(set(pids)) == 3 and os.getpid() not in pids

        echo.agents.clear()
        remote = post_all(poster, echo.url + PATH)
        remote_agents = list(echo.agents)
        local = post_all(LocalPoster(), echo.url + PATH)
        assert remote == local  # status, body bytes, engine header
        assert [json.loads(r.body)["seed"] for r in remote] == [p["seed"] for p in PAYLOADS]
        assert all(r.status == 200 for r in remote)
        # the server saw the first 7 POSTs from the actors, round-robin (3, 2, 2); the last 7 from elsewhere
        sent_by = Counter(poster_pid(agent) for agent in remote_agents)
        assert sent_by == {pids[0]: 3, pids[1]: 2, pids[2]: 2}
        assert all(poster_pid(agent) is None for agent in echo.agents[len(PAYLOADS) :])
        assert [i["posts"] for i in poster.info()] == [3, 2, 2]

        # through the miles router (as the sglang rollout posts): the same bodies, the engine named
        router = MilesRouter(RouterConfig(concurrency=4, health_check_interval=60.0))
        router.start()
        try:
            router.add_worker(echo.url)
            via_router = post_all(poster, router.url + PATH)
            via_router_local = post_all(LocalPoster(), router.url + PATH)
        finally:
            router.stop()
        assert via_router == via_router_local
        assert [r.body for r in via_router] == [r.body for r in local]
        assert {r.engine for r in via_router} == {echo.url}
        assert sum(i["posts"] for i in poster.info()) == 2 * len(PAYLOADS)
    finally:
        poster.shutdown()
    assert poster.actors == []
