"""The reward service: rewards scored over HTTP, for trainers on other machines (`client.py` is its client).

    POST /score    a batch of items (see `protocol.py`) -> {"rewards": [...]}
    GET  /health   {"status": "ok", "version": PROTOCOL_VERSION, "miles_version": ..., "rewards": [names]}

    app = make_app({"digit": scorer, ...})        # an aiohttp app over `Scorer`s (`dispatch.Scorer`)
    serve(settings, ["digit"], "0.0.0.0", 8000)   # the built-ins, until SIGINT / SIGTERM

Scoring runs in one worker thread per reward (the model's forward never blocks the event loop; one reward's
batches run one at a time, different rewards in parallel). Concurrent requests for the same reward are merged:
the first waits `batch_window_s` (5 ms) for others, then up to `max_batch_size` items go to the scorer as one
call and the rewards are split back; while a batch is scoring the next one gathers. A request larger than
`max_batch_size` is scored in pieces. A merged batch that fails is re-scored request by request, so a bad item
fails only the request that sent it: 500 with the `RewardError` line naming the item (`score_items`),
`retryable: false`. Built-in models load on the first request of their reward (in the worker thread).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from miles.core.errors import ConfigError
from miles.rewards import REWARD_TYPES
from miles.rewards.dispatch import (
    RewardError,
    RewardSettings,
    Scorer,
    build_scorer,
    check_settings,
    describe_sample,
    score_items,
)
from miles.rewards.service.protocol import (
    JSON,
    MSGPACK,
    MSGPACK_TYPES,
    PROTOCOL_VERSION,
    ProtocolError,
    ScoreItem,
    decode_request,
    encode_error,
    encode_response,
    media_type,
)

DEFAULT_MAX_BATCH_SIZE = 64
DEFAULT_BATCH_WINDOW_S = 0.005
DEFAULT_MAX_REQUEST_BYTES = 1 << 30  # a batch of PNGs; aiohttp's own default is 1 MiB


def miles_version() -> str:
    from miles import __version__

    return __version__


class LazyScorer:
    """A built-in reward's scorer, built (its model loaded) on the first call, once."""

    def __init__(self, settings: RewardSettings, rm_type: str) -> None:
        self.settings = settings
        self.rm_type = rm_type
        self._scorer: Scorer | None = None
        self._lock = threading.Lock()

    def load(self) -> Scorer:
        with self._lock:
            if self._scorer is None:
                try:
                    self._scorer = build_scorer(self.settings, self.rm_type)
                except ConfigError:
                    raise
                except Exception as exc:
                    raise RewardError(f"reward {self.rm_type!r} could not load: {type(exc).__name__}: {exc}") from exc
            return self._scorer

    def __call__(self, images: Sequence[Any], prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]) -> Any:
        return self.load()(images, prompts, metadata)


def builtin_scorers(settings: RewardSettings, rm_types: Iterable[str]) -> dict[str, Scorer]:
    """name -> a lazily loaded built-in scorer; ConfigError now for a type the settings cannot serve."""
    scorers: dict[str, Scorer] = {}
    for rm_type in dict.fromkeys(rm_types):
        check_settings(settings, rm_type)
        if REWARD_TYPES[rm_type].sourced:
            raise ConfigError(
                f"miles reward serve cannot serve {rm_type}: it scores an edit against its source image, and the "
                "service's protocol carries no source images; score it in the job"
            )
        scorers[rm_type] = LazyScorer(settings, rm_type)
    return scorers


# ---- batching ----------------------------------------------------------------------------------
@dataclass
class _Request:
    items: list[ScoreItem]
    future: asyncio.Future[list[float]]
    results: list[float | None] = field(default_factory=list)
    pending: int = 0  # parts not scored yet


@dataclass
class _Part:
    request: _Request
    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start


class RewardBatcher:
    """One reward's queue: merges concurrent requests into batches of up to `max_batch_size` items."""

    def __init__(self, name: str, scorer: Scorer, max_batch_size: int, window_s: float) -> None:
        if max_batch_size < 1:
            raise ConfigError(f"max_batch_size must be at least 1, got {max_batch_size}")
        self.name = name
        self.scorer = scorer
        self.max_batch_size = int(max_batch_size)
        self.window_s = float(window_s)
        self.calls = 0  # scorer calls on merged batches (for tests and logs)
        self._parts: deque[_Part] = deque()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"reward-{name}")

    async def score(self, items: list[ScoreItem]) -> list[float]:
        if not items:
            return []
        loop = asyncio.get_running_loop()
        request = _Request(items, loop.create_future(), [None] * len(items))
        for start in range(0, len(items), self.max_batch_size):
            self._parts.append(_Part(request, start, min(start + self.max_batch_size, len(items))))
            request.pending += 1
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._run(), name=f"reward-batcher-{self.name}")
        self._wake.set()
        return await request.future

    def _queued(self) -> int:
        return sum(len(p) for p in self._parts)

    def _take(self) -> list[_Part]:
        batch: list[_Part] = []
        size = 0
        while self._parts:
            part = self._parts[0]
            if part.request.future.done():  # the client went away
                self._parts.popleft()
                continue
            if batch and size + len(part) > self.max_batch_size:
                break
            batch.append(self._parts.popleft())
            size += len(part)
        return batch

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._parts:
                self._wake.clear()
                await self._wake.wait()
                continue
            if self.window_s > 0 and self._queued() < self.max_batch_size:
                await asyncio.sleep(self.window_s)  # let concurrent requests join this batch
            batch = self._take()
            if not batch:
                continue
            try:
                outcomes = await loop.run_in_executor(self._executor, self._score_batch, batch)
            except Exception as exc:  # the executor itself failed (shut down): never leave a request waiting
                error = RewardError(f"reward {self.name!r} could not run: {type(exc).__name__}: {exc}")
                outcomes = [error] * len(batch)
            for part, outcome in zip(batch, outcomes, strict=True):
                request = part.request
                if request.future.done():
                    continue
                if isinstance(outcome, BaseException):
                    request.future.set_exception(outcome)
                    continue
                request.results[part.start : part.stop] = outcome
                request.pending -= 1
                if request.pending == 0:
                    request.future.set_result(list(request.results))  # type: ignore[arg-type]

    def _score_part(self, scorer: Scorer, parts: list[_Part]) -> list[float]:
        items = [it for p in parts for it in p.request.items[p.start : p.stop]]
        names = [
            it.name or describe_sample(p.start + k, it.prompt)
            for p in parts
            for k, it in enumerate(p.request.items[p.start : p.stop])
        ]
        return score_items(
            self.name,
            scorer,
            [it.image for it in items],
            [it.prompt for it in items],
            [it.metadata for it in items],
            names,
        )

    def _score_batch(self, batch: list[_Part]) -> list[list[float] | BaseException]:
        """In the worker thread: one scorer call for the whole batch; on failure, each request on its own."""
        self.calls += 1
        try:
            scorer = self.scorer.load() if isinstance(self.scorer, LazyScorer) else self.scorer
        except Exception as exc:  # a model that cannot load fails the whole batch, once
            return [exc] * len(batch)
        try:
            values = self._score_part(scorer, batch)
        except Exception as exc:
            if len(batch) == 1:
                return [exc]
            outcomes: list[list[float] | BaseException] = []
            for part in batch:
                try:
                    outcomes.append(self._score_part(scorer, [part]))
                except Exception as part_exc:
                    outcomes.append(part_exc)
            return outcomes
        out: list[list[float] | BaseException] = []
        offset = 0
        for part in batch:
            out.append(values[offset : offset + len(part)])
            offset += len(part)
        return out

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for part in self._parts:
            if not part.request.future.done():
                part.request.future.set_exception(RewardError(f"the reward service stopped (reward {self.name!r})"))
        self._parts.clear()
        self._executor.shutdown(wait=False, cancel_futures=True)


# ---- the app -----------------------------------------------------------------------------------
BATCHERS = web.AppKey("miles_reward_batchers", dict)


def _answer_format(request: web.Request) -> str:
    if media_type(request.content_type) in MSGPACK_TYPES or MSGPACK in request.headers.get("Accept", ""):
        return MSGPACK
    return JSON


def _error(message: str, status: int, fmt: str = JSON, *, retryable: bool = True) -> web.Response:
    return web.Response(status=status, body=encode_error(message, fmt, retryable=retryable), content_type=fmt)


async def _health(request: web.Request) -> web.Response:
    batchers: dict[str, RewardBatcher] = request.app[BATCHERS]
    return web.json_response(
        {"status": "ok", "version": PROTOCOL_VERSION, "miles_version": miles_version(), "rewards": list(batchers)}
    )


async def _score(request: web.Request) -> web.Response:
    batchers: dict[str, RewardBatcher] = request.app[BATCHERS]
    body = await request.read()
    fmt = _answer_format(request)
    try:  # PNG decoding is CPU work: off the event loop
        parsed = await asyncio.to_thread(decode_request, body, request.headers.get("Content-Type"))
    except ProtocolError as exc:
        return _error(str(exc), exc.status, fmt if exc.status != 415 else JSON, retryable=False)
    except Exception as exc:  # a PNG PIL cannot read, memory ...
        return _error(f"cannot read the request: {type(exc).__name__}: {exc}", 400, fmt, retryable=False)
    batcher = batchers.get(parsed.reward)
    if batcher is None:
        served = ", ".join(batchers) or "none"
        return _error(f"reward {parsed.reward!r} is not served here (serving: {served})", 404, fmt, retryable=False)
    try:
        rewards = await batcher.score(parsed.items)
    except (RewardError, ConfigError) as exc:
        return _error(str(exc), 500, fmt, retryable=False)
    except Exception as exc:
        return _error(f"reward {parsed.reward!r} failed: {type(exc).__name__}: {exc}", 500, fmt)
    return web.Response(body=encode_response(rewards, fmt), content_type=fmt)


async def _close_batchers(app: web.Application) -> None:
    for batcher in app[BATCHERS].values():
        await batcher.close()


def make_app(
    scorers: Mapping[str, Scorer],
    *,
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
    batch_window_s: float = DEFAULT_BATCH_WINDOW_S,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
) -> web.Application:
    """The service over `scorers` (name -> `Scorer`); `app[BATCHERS][name].calls` counts scorer calls."""
    if not scorers:
        raise ConfigError("the reward service needs at least one reward to serve")
    app = web.Application(client_max_size=max_request_bytes)
    app[BATCHERS] = {
        name: RewardBatcher(name, scorer, max_batch_size, batch_window_s) for name, scorer in scorers.items()
    }
    app.router.add_get("/health", _health)
    app.router.add_post("/score", _score)
    app.on_cleanup.append(_close_batchers)
    return app


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _write_ready_file(path: str, url: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(url + "\n")
    os.replace(tmp, path)  # readers never see half a line


async def run_service(
    scorers: Mapping[str, Scorer],
    host: str,
    port: int,
    *,
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
    batch_window_s: float = DEFAULT_BATCH_WINDOW_S,
    ready_file: str | None = None,
    stop: asyncio.Event | None = None,
    announce: Callable[[str], None] | None = print,
    preload: bool = False,
) -> None:
    """Serve `scorers` on host:port until `stop` is set (or SIGINT / SIGTERM in the main thread). Port 0 picks
    a free port; the real URL is written to `ready_file` (one line) and announced once the service listens.
    `preload`: load the built-in models first (a load error is raised here, before the service listens)."""
    if preload:
        await asyncio.to_thread(lambda: [s.load() for s in scorers.values() if isinstance(s, LazyScorer)])
    app = make_app(scorers, max_batch_size=max_batch_size, batch_window_s=batch_window_s)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    handled: list[int] = []
    try:
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
        except OSError as exc:
            raise ConfigError(f"the reward service cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
        real_port = runner.addresses[0][1] if runner.addresses else port
        url = f"http://{_url_host(host)}:{real_port}"
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                with contextlib.suppress(NotImplementedError, RuntimeError):
                    loop.add_signal_handler(sig, stop.set)
                    handled.append(sig)
        if ready_file:
            _write_ready_file(ready_file, url)
        if announce is not None:
            announce(f"miles: reward service on {url} serving {', '.join(scorers)}")
        await stop.wait()
    finally:
        for sig in handled:
            loop.remove_signal_handler(sig)
        await runner.cleanup()


def serve(
    settings: RewardSettings,
    rm_types: list[str],
    host: str,
    port: int,
    *,
    extra: Mapping[str, Scorer] | None = None,
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
    ready_file: str | None = None,
    preload: bool = False,
) -> None:
    """`miles reward serve`: the built-in rewards `rm_types`, and the `extra` scorers under their names (a
    `--custom-rm-path`), on host:port until SIGINT / SIGTERM.

    Prints `miles: reward service on http://host:port serving digit, ...` once it listens (port 0: a free
    port, the one printed and written to `ready_file`). ConfigError for an unknown reward or a busy port.
    Models load on the first request of their reward, or before the service listens with `preload`."""
    if not rm_types and not extra:
        raise ConfigError("miles reward serve needs at least one reward type (--rm-type)")
    scorers = {**builtin_scorers(settings, rm_types), **(extra or {})}
    asyncio.run(
        run_service(
            scorers,
            host,
            port,
            max_batch_size=max_batch_size,
            ready_file=ready_file,
            announce=lambda line: print(line, flush=True),
            preload=preload,
        )
    )
