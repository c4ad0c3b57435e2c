"""The miles router: an HTTP reverse proxy that balances rollout requests over several engine servers.

The router is protocol-agnostic. Any method and path (typically ``POST /rollout/generate``) is forwarded to
one engine with the request body bytes and ``Content-Type`` unchanged, and the engine's status, body bytes and
``Content-Type`` come back unchanged (plus an ``X-Miles-Engine`` header naming the engine that answered).

Routing picks the engine with the fewest active requests; ties go round-robin. An engine already holding
``concurrency`` requests is never chosen; when every engine is at the cap the request waits for a free slot.

Failures:
  * connection-level (refused, reset, disconnected): the engine is removed from routing at once, the
    ``on_engine_removed`` callback fires, and the request is re-sent to another engine (``max_retries`` times);
    when nothing is left the caller gets 503 with a JSON body naming the failed engines.
  * ``timeout`` exceeded: 504 naming the engine; no retry, the engine stays.
  * HTTP error statuses (4xx/5xx) are the engine's answer and are passed through as-is.
  * a background health loop removes an engine after ``failure_threshold`` consecutive failed checks.

The router's own endpoints: ``POST /add_worker?url=...``, ``POST /remove_worker?url=...``,
``GET /list_workers`` and ``GET /health``. Everything else is proxied.

The router binds ``RouterConfig.host`` and hands out ``url``, built on ``advertise_host`` (the address the other
hosts reach: the node's IP for a wildcard bind). Engines are added by their advertised URLs.

The server runs on its own event loop in a daemon thread, so it can be driven from synchronous code::

    router = MilesRouter(RouterConfig(concurrency=64))
    base_url = router.start()
    router.add_worker("http://127.0.0.1:30000")
    ...
    router.stop()
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import aiohttp
from aiohttp import hdrs, web
from yarl import URL

from miles.utils.net import http_url, local_host

logger = logging.getLogger("miles.router")

ENGINE_HEADER = "X-Miles-Engine"

# Request bodies (prompts, latents) may be large; aiohttp's server default caps them at 1 MiB.
_MAX_BODY_BYTES = 1 << 30
# Idle pooled connections are dropped before uvicorn's default 5 s keep-alive would close them from the engine
# side, so that a request is not sent on a connection the engine is closing (which would look like a dead engine).
_KEEPALIVE_TIMEOUT = 4.0
# How long stop() lets in-flight requests finish before their connections are closed.
_SHUTDOWN_GRACE = 2.0
_START_TIMEOUT = 30.0
_JOIN_TIMEOUT = 30.0

# Exceptions meaning "the engine could not be reached or dropped the connection".
_CONNECTION_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError)


@dataclass
class RouterConfig:
    """Settings of a :class:`MilesRouter` (the matching command-line flag in brackets)."""

    host: str = "127.0.0.1"  # the bind address (--rollout-engine-host, resolved on the manager's node)
    port: int = 0  # 0: pick a free port
    # what the router tells the others (its `url`); None: the bind address, or loopback for a wildcard bind.
    # A wildcard bind must be given the node's own address here: 0.0.0.0 is nobody's address.
    advertise_host: str | None = None
    concurrency: int = 512  # max in-flight requests per engine (--sglang-server-concurrency)
    timeout: float | None = None  # per-request timeout in seconds (--miles-router-timeout); None: no limit
    # Connector-wide cap on open connections to engines (--miles-router-max-connections). None: no cap
    # beyond the per-engine ``concurrency`` (plus the health checks).
    max_connections: int | None = None
    health_check_interval: float = 30.0  # seconds between health rounds (--rollout-health-check-interval); <= 0: off
    health_check_timeout: float = 30.0  # (--rollout-health-check-timeout)
    # consecutive failed checks before an engine is removed (--miles-router-health-check-failure-threshold)
    failure_threshold: int = 3
    health_check_first_wait: float = 0.0  # grace before the first round (--rollout-health-check-first-wait)
    health_path: str = "/health"
    max_retries: int = 2  # re-sends to other engines after a connection-level failure

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        if self.failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {self.failure_threshold}")
        if self.timeout is not None and self.timeout <= 0:
            raise ValueError(f"timeout must be > 0 or None, got {self.timeout}")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1 or None, got {self.max_connections}")


class _Engine:
    """One engine and its counters. A re-added url gets a fresh object, so stale requests never touch it."""

    __slots__ = ("active", "errors", "failures", "last_pick", "removed_reason", "served", "url")

    def __init__(self, url: str) -> None:
        self.url = url
        self.served = 0  # responses received (any HTTP status)
        self.active = 0  # requests in flight
        self.failures = 0  # consecutive failed health checks
        self.errors = 0  # connection-level errors
        self.removed_reason: str | None = None
        self.last_pick = 0  # value of the router's pick counter when last chosen (0: never)


def _normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")) or len(url.split("://", 1)[1]) == 0:
        raise ValueError(f"engine url must look like http://host:port, got {url!r}")
    return url


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _json_error(status: int, error: str, engines: dict[str, str], engine: str | None = None) -> web.Response:
    response = web.json_response({"error": error, "engines": engines}, status=status)
    if engine is not None:
        response.headers[ENGINE_HEADER] = engine
    return response


class MilesRouter:
    """Least-loaded HTTP load balancer over rollout engine servers, served from a background thread.

    Engine bookkeeping is guarded by a lock so that :meth:`add_worker`, :meth:`remove_worker`,
    :meth:`workers`, :meth:`removed` and :meth:`stats` may be called from any thread, before or after
    :meth:`start`. ``on_engine_removed(url, reason)`` is called (in a worker thread, never on the event loop)
    when an engine is removed because of a connection failure or failed health checks, not for
    :meth:`remove_worker`. It must not call :meth:`stop`.
    """

    def __init__(self, config: RouterConfig, on_engine_removed: Callable[[str, str], None] | None = None) -> None:
        self.config = config
        self._on_engine_removed = on_engine_removed
        self._lock = threading.Lock()
        self._lifecycle = threading.Lock()  # serializes start() and stop()
        self._engines: dict[str, _Engine] = {}  # every known engine, routable or removed, in insertion order
        self._picks = 0  # requests routed so far; stamps _Engine.last_pick
        self._url = ""
        self._local_url = ""
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_event: asyncio.Event | None = None
        self._changed: asyncio.Event | None = None  # set (and replaced) whenever a slot frees or engines change
        self._session: aiohttp.ClientSession | None = None
        self._callbacks: ThreadPoolExecutor | None = None

    # ------------------------------------------------------------------ lifecycle

    @property
    def url(self) -> str:
        """Base url of the running router as the others reach it, ``http://advertised-host:port`` (empty before
        :meth:`start`)."""
        return self._url

    @property
    def local_url(self) -> str:
        """Base url of the running router from its own host (a wildcard bind: loopback)."""
        return self._local_url

    def start(self) -> str:
        """Start serving in a daemon thread; return the base url once the router is listening."""
        with self._lifecycle:
            return self._start()

    def _start(self) -> str:
        if self._thread is not None:
            raise RuntimeError("router already started")
        ready = threading.Event()
        failure: list[BaseException] = []
        self._callbacks = ThreadPoolExecutor(max_workers=1, thread_name_prefix="miles-router-callback")
        thread = threading.Thread(target=self._thread_main, args=(ready, failure), name="miles-router", daemon=True)
        thread.start()
        if not ready.wait(_START_TIMEOUT):
            raise RuntimeError(f"router did not start within {_START_TIMEOUT} s")
        if failure:
            thread.join(_JOIN_TIMEOUT)
            self._callbacks.shutdown(wait=False)
            self._callbacks = None
            raise failure[0]
        self._thread = thread
        logger.info("miles router listening on %s", self._url)
        return self._url

    def stop(self) -> None:
        """Stop the server and the health loop, close the client session and join the thread. Idempotent."""
        with self._lifecycle:
            thread, loop, stop_event = self._thread, self._loop, self._stop_event
            self._thread = None
            if thread is not None:
                self._stop(thread, loop, stop_event)

    def _stop(
        self, thread: threading.Thread, loop: asyncio.AbstractEventLoop | None, stop_event: asyncio.Event | None
    ) -> None:
        if loop is not None and stop_event is not None:
            with contextlib.suppress(RuntimeError):  # loop already closed
                loop.call_soon_threadsafe(stop_event.set)
        thread.join(_JOIN_TIMEOUT)
        if thread.is_alive():
            logger.warning("miles router thread did not finish within %s s", _JOIN_TIMEOUT)
        if self._callbacks is not None:
            self._callbacks.shutdown(wait=False)
            self._callbacks = None
        logger.info("miles router at %s stopped", self._url)

    def _thread_main(self, ready: threading.Event, failure: list[BaseException]) -> None:
        try:
            asyncio.run(self._serve(ready, failure))
        except BaseException as exc:  # setup errors are reported by _serve; anything else is logged
            if not ready.is_set():
                failure.append(exc)
                ready.set()
            else:
                logger.exception("miles router thread crashed")
        finally:
            self._loop = None

    async def _serve(self, ready: threading.Event, failure: list[BaseException]) -> None:
        cfg = self.config
        self._loop = asyncio.get_running_loop()
        self._stop_event = asyncio.Event()
        self._changed = asyncio.Event()
        connector = aiohttp.TCPConnector(
            limit=cfg.max_connections or 0, limit_per_host=0, keepalive_timeout=_KEEPALIVE_TIMEOUT
        )
        self._session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=cfg.timeout))
        app = web.Application(client_max_size=_MAX_BODY_BYTES)
        app.router.add_post("/add_worker", self._handle_add_worker)
        app.router.add_post("/remove_worker", self._handle_remove_worker)
        app.router.add_get("/list_workers", self._handle_list_workers)
        app.router.add_get("/health", self._handle_health)
        app.router.add_route("*", "/{tail:.*}", self._handle_proxy)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=_SHUTDOWN_GRACE)
        try:
            await runner.setup()
            site = web.TCPSite(runner, cfg.host, cfg.port)
            await site.start()
            port = runner.addresses[0][1]
        except BaseException as exc:
            await runner.cleanup()
            await self._session.close()
            failure.append(exc)
            ready.set()
            return
        self._url = http_url(cfg.advertise_host or local_host(cfg.host), port)
        self._local_url = http_url(local_host(cfg.host), port)
        ready.set()

        health_task = asyncio.create_task(self._health_loop()) if cfg.health_check_interval > 0 else None
        try:
            await self._stop_event.wait()
        finally:
            if health_task is not None:
                health_task.cancel()
                await asyncio.gather(health_task, return_exceptions=True)
            await runner.cleanup()
            await self._session.close()

    # ------------------------------------------------------------------ engine set (any thread)

    def add_worker(self, url: str) -> None:
        """Make ``url`` routable. Re-adding a removed url revives it with its counters reset."""
        url = _normalize_url(url)
        with self._lock:
            current = self._engines.get(url)
            if current is not None and current.removed_reason is None:
                return
            self._engines.pop(url, None)
            self._engines[url] = _Engine(url)
        logger.info("engine added: %s%s", url, " (revived)" if current is not None else "")
        self._wake_threadsafe()

    def remove_worker(self, url: str) -> None:
        """Take ``url`` out of routing (in-flight requests finish). Unknown urls are ignored."""
        self._remove_url(_normalize_url(url), "removed by remove_worker")

    def workers(self) -> list[str]:
        """Healthy, routable engines in insertion order."""
        with self._lock:
            return [e.url for e in self._engines.values() if e.removed_reason is None]

    def removed(self) -> dict[str, str]:
        """Removed engines: url -> reason."""
        with self._lock:
            return {e.url: e.removed_reason for e in self._engines.values() if e.removed_reason is not None}

    def stats(self) -> dict[str, dict[str, int]]:
        """Counters of every known engine: served, active, failures (consecutive failed checks), errors."""
        with self._lock:
            return {
                e.url: {"served": e.served, "active": e.active, "failures": e.failures, "errors": e.errors}
                for e in self._engines.values()
            }

    def _remove_url(self, url: str, reason: str) -> bool:
        with self._lock:
            engine = self._engines.get(url)
        return engine is not None and self._remove(engine, reason, notify=False)

    def _remove(self, engine: _Engine, reason: str, notify: bool) -> bool:
        """Mark ``engine`` removed unless it already is (or was replaced by a re-add). True if it was removed."""
        with self._lock:
            if self._engines.get(engine.url) is not engine or engine.removed_reason is not None:
                return False
            engine.removed_reason = reason
        logger.info("engine removed: %s (%s)", engine.url, reason)
        self._wake_threadsafe()
        if notify and self._on_engine_removed is not None:
            self._schedule_callback(engine.url, reason)
        return True

    def _schedule_callback(self, url: str, reason: str) -> None:
        loop, executor = self._loop, self._callbacks
        if loop is None or executor is None:
            self._run_callback(url, reason)
            return
        try:
            loop.call_soon_threadsafe(loop.run_in_executor, executor, self._run_callback, url, reason)
        except RuntimeError:  # loop closed while stopping
            self._run_callback(url, reason)

    def _run_callback(self, url: str, reason: str) -> None:
        assert self._on_engine_removed is not None
        try:
            self._on_engine_removed(url, reason)
        except Exception:
            logger.exception("on_engine_removed(%r, %r) raised", url, reason)

    # ------------------------------------------------------------------ slots (event loop only)

    def _wake(self) -> None:
        """Wake every request waiting for a slot so it re-evaluates the engines. Event-loop thread only."""
        if self._changed is not None:
            self._changed.set()
            self._changed = asyncio.Event()

    def _wake_threadsafe(self) -> None:
        loop = self._loop
        if loop is None:
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._wake()
            return
        with contextlib.suppress(RuntimeError):  # loop closed while stopping
            loop.call_soon_threadsafe(self._wake)

    def _pick(self, exclude: Collection[str]) -> tuple[_Engine | None, bool]:
        """Reserve a slot on the least-active free engine; ties go to the least recently picked (round-robin).

        Returns ``(engine, True)`` on success, ``(None, True)`` when every candidate is at the concurrency cap
        and ``(None, False)`` when no candidate is left.
        """
        cap = self.config.concurrency
        with self._lock:
            candidates = [e for e in self._engines.values() if e.removed_reason is None and e.url not in exclude]
            free = [e for e in candidates if e.active < cap]
            if not free:
                return None, bool(candidates)
            engine = min(free, key=lambda e: (e.active, e.last_pick))
            self._picks += 1
            engine.last_pick = self._picks
            engine.active += 1
            return engine, True

    async def _acquire(self, exclude: Collection[str]) -> _Engine | None:
        """Reserve a slot, waiting while every candidate is at the cap; None when no candidate is left."""
        while True:
            changed = self._changed
            assert changed is not None
            engine, any_left = self._pick(exclude)
            if engine is not None or not any_left:
                return engine
            await changed.wait()

    def _release(self, engine: _Engine) -> None:
        engine.active -= 1
        self._wake()

    # ------------------------------------------------------------------ proxy

    async def _handle_proxy(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {hdrs.ACCEPT_ENCODING: "identity"}
        content_type = request.headers.get(hdrs.CONTENT_TYPE)
        if content_type is not None:
            headers[hdrs.CONTENT_TYPE] = content_type
        failed: dict[str, str] = {}
        for _ in range(self.config.max_retries + 1):
            engine = await self._acquire(exclude=failed.keys())
            if engine is None:
                break
            try:
                status, payload, reply_type = await self._forward(engine, request, headers, body)
            except TimeoutError:
                reason = f"timed out after {self.config.timeout} s"
                logger.warning("engine %s %s on %s %s", engine.url, reason, request.method, request.path)
                return _json_error(504, f"engine {engine.url} {reason}", {engine.url: reason}, engine=engine.url)
            except _CONNECTION_ERRORS as exc:
                engine.errors += 1
                reason = f"connection failed: {_describe(exc)}"
                failed[engine.url] = reason
                logger.warning("engine %s: %s; retrying elsewhere", engine.url, reason)
                self._remove(engine, reason, notify=True)
                continue
            except aiohttp.ClientError as exc:  # e.g. a malformed HTTP answer: not the engine's fault to retry
                reason = f"bad response: {_describe(exc)}"
                return _json_error(502, f"engine {engine.url}: {reason}", {engine.url: reason}, engine=engine.url)
            finally:
                self._release(engine)
            engine.served += 1
            response = web.Response(status=status, body=payload)
            if reply_type is not None:
                response.headers[hdrs.CONTENT_TYPE] = reply_type
            response.headers[ENGINE_HEADER] = engine.url
            return response

        if failed:
            error = f"{len(failed)} engine(s) failed at the connection level"
            return _json_error(503, error, failed)
        return _json_error(503, "no routable engines", self.removed())

    async def _forward(
        self, engine: _Engine, request: web.Request, headers: dict[str, str], body: bytes
    ) -> tuple[int, bytes, str | None]:
        assert self._session is not None
        target = URL(engine.url + request.raw_path, encoded=True)
        async with self._session.request(request.method, target, data=body or None, headers=headers) as resp:
            payload = await resp.read()
            return resp.status, payload, resp.headers.get(hdrs.CONTENT_TYPE)

    # ------------------------------------------------------------------ health

    async def _health_loop(self) -> None:
        if self.config.health_check_first_wait > 0:
            await asyncio.sleep(self.config.health_check_first_wait)
        while True:
            await asyncio.sleep(self.config.health_check_interval)
            with self._lock:
                targets = [e for e in self._engines.values() if e.removed_reason is None]
            if targets:
                await asyncio.gather(*(self._check(engine) for engine in targets))

    async def _check(self, engine: _Engine) -> None:
        assert self._session is not None
        cfg = self.config
        try:
            timeout = aiohttp.ClientTimeout(total=cfg.health_check_timeout)
            async with self._session.get(engine.url + cfg.health_path, timeout=timeout) as resp:
                await resp.read()
                detail = f"HTTP {resp.status}"
                ok = resp.status == 200
        except (aiohttp.ClientError, TimeoutError) as exc:
            detail, ok = _describe(exc), False
        if ok:
            engine.failures = 0
            return
        engine.failures += 1
        logger.warning(
            "engine %s failed health check %d/%d: %s", engine.url, engine.failures, cfg.failure_threshold, detail
        )
        if engine.failures >= cfg.failure_threshold:
            self._remove(engine, f"failed {engine.failures} consecutive health checks", notify=True)

    # ------------------------------------------------------------------ router endpoints

    def _url_param(self, request: web.Request) -> str:
        url = request.query.get("url")
        if not url:
            raise web.HTTPBadRequest(text="missing query parameter: url")
        try:
            return _normalize_url(url)
        except ValueError as exc:
            raise web.HTTPBadRequest(text=str(exc)) from exc

    async def _handle_add_worker(self, request: web.Request) -> web.Response:
        url = self._url_param(request)
        self.add_worker(url)
        return web.json_response({"added": url, "workers": self.workers()})

    async def _handle_remove_worker(self, request: web.Request) -> web.Response:
        url = self._url_param(request)
        if not self._remove_url(url, "removed by remove_worker") and url not in self.removed():
            return web.json_response({"error": f"unknown engine {url}", "workers": self.workers()}, status=404)
        return web.json_response({"removed": url, "workers": self.workers()})

    async def _handle_list_workers(self, request: web.Request) -> web.Response:
        return web.json_response({"workers": self.workers(), "removed": self.removed()})

    async def _handle_health(self, request: web.Request) -> web.Response:
        workers = self.workers()
        return web.json_response({"workers": len(workers)}, status=200 if workers else 503)
