"""The client of the reward service (`server.py`): rewards scored on another machine over HTTP.

    client = RemoteRewardClient("http://rm-host:8000", "digit")
    await client.check()                                     # at job start: ConfigError on a mismatch
    await client.served()                                    # the names the service serves
    rewards = await client.score(images, prompts, metadata, names)   # list[float], in order

A call is split into batches of `batch_size` items, at most `max_in_flight` of them on the wire at once
(per event loop); each request has `timeout_s` (and `connect_timeout_s` to connect). A failed request (no
connection, a dropped connection, a timeout, a 5xx the server marks retryable) is re-sent up to `retries`
times after `backoff_s`, 2x, 4x ... seconds; then `RewardError`, one line naming the URL. With the defaults an
unreachable service fails within 4 x 5 s + 3.5 s = 23.5 s (a refused connection: within 4 s).

`fault_tolerant=True` (`--use-fault-tolerance`): a service that is down (refused or dropped connection) is
waited for instead: `/health` is polled every `poll_s` up to `wait_s` seconds (one poll per event loop, shared
by the waiting batches), then the unfinished batches are re-sent; a service that does not come back in
`wait_s` is a `RewardError`. A batch whose service goes down more than `retries` + 1 times while scoring it is
a `RewardError` too (the batch may be what kills it).

Not retried: a reward that failed on its input (500 with `retryable: false`, the server's `RewardError` line
naming the item, re-raised as a `RewardError` with the URL added), a request the service refused (4xx) and a
reward it does not serve (404: `ConfigError`). One aiohttp session per event loop, reused by every call.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp

from miles.core.errors import ConfigError
from miles.rewards.errors import RewardError, describe_sample, describe_samples
from miles.rewards.service.protocol import (
    JSON,
    MSGPACK,
    PROTOCOL_VERSION,
    ProtocolError,
    decode_response,
    encode_request,
    one_line,
    read_rewards,
)

if TYPE_CHECKING:
    from miles.core.sample import Sample

logger = logging.getLogger("miles.reward_service")

DEFAULT_BATCH_SIZE = 32
DEFAULT_MAX_IN_FLIGHT = 4
DEFAULT_TIMEOUT_S = 60.0
DEFAULT_CONNECT_TIMEOUT_S = 5.0
DEFAULT_RETRIES = 3
DEFAULT_BACKOFF_S = 0.5
DEFAULT_WAIT_S = 120.0
DEFAULT_POLL_S = 1.0
HEALTH_TIMEOUT_S = 10.0


def _reward_error(message: str) -> Exception:
    return RewardError(message)


def _describe(names: Sequence[str]) -> str:
    return describe_samples(list(names))


class _Down(Exception):
    """The service is not there: connection refused, dropped or not made in time."""


class _Transient(Exception):
    """The service is there but this request failed in a way a re-send may fix (timeout, retryable 5xx)."""


@dataclass
class _LoopState:
    session: aiohttp.ClientSession
    semaphore: asyncio.Semaphore
    recovery: asyncio.Future[None] | None = None
    closer: Any = None  # the async generator that closes the session when its loop shuts down


async def _close_at_loop_shutdown(session: aiohttp.ClientSession) -> Any:
    """Parked at its `yield` for the loop's life: `asyncio.run` (`loop.shutdown_asyncgens()`) finalises it,
    closing the session, so a client reused across calls never leaves an unclosed session behind."""
    try:
        yield
    finally:
        await session.close()


def normalize_url(url: str) -> str:
    """`host:8000` -> `http://host:8000`; no trailing slash; ConfigError for another scheme or no host."""
    text = str(url).strip().rstrip("/")
    if "://" not in text:
        text = f"http://{text}"
    scheme, _, rest = text.partition("://")
    if scheme.lower() not in ("http", "https") or not rest or rest.startswith("/"):
        raise ConfigError(f"reward service URL {url!r} must be http://host:port (or https://)")
    return f"{scheme.lower()}://{rest}"


def _connect_cause(exc: BaseException) -> str:
    if isinstance(exc, aiohttp.ClientConnectorError):
        os_error = exc.os_error
        if getattr(os_error, "errno", None) == errno.ECONNREFUSED or isinstance(os_error, ConnectionRefusedError):
            return "connection refused"
        return one_line(getattr(os_error, "strerror", None) or str(os_error) or type(os_error).__name__, 200)
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "the server closed the connection"
    return one_line(f"{type(exc).__name__}: {exc}", 200)


class RemoteRewardClient:
    """Scores one reward (`reward`, a name the service serves) on the reward service at `url`. The first `score()`
    checks the service (`check()`) unless a `check()` already passed."""

    def __init__(
        self,
        url: str,
        reward: str,
        *,
        batch_size: int = DEFAULT_BATCH_SIZE,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        retries: int = DEFAULT_RETRIES,
        backoff_s: float = DEFAULT_BACKOFF_S,
        fault_tolerant: bool = False,
        wait_s: float = DEFAULT_WAIT_S,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        poll_s: float = DEFAULT_POLL_S,
        wire: str = MSGPACK,
    ) -> None:
        self.url = normalize_url(url)
        self.reward = str(reward)
        self._checked = False  # check() passed once: the first score() runs it
        for name, value, low in (
            ("batch_size", batch_size, 1),
            ("max_in_flight", max_in_flight, 1),
            ("retries", retries, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"remote reward {name} must be an integer >= {low}, got {value!r}")
        for name, value in (
            ("timeout_s", timeout_s),
            ("backoff_s", backoff_s),
            ("wait_s", wait_s),
            ("connect_timeout_s", connect_timeout_s),
            ("poll_s", poll_s),
        ):
            if not float(value) >= 0 or (name in ("timeout_s", "connect_timeout_s", "poll_s") and not value > 0):
                raise ConfigError(f"remote reward {name} must be a positive number of seconds, got {value!r}")
        if wire not in (MSGPACK, JSON):
            raise ConfigError(f"remote reward wire format must be {MSGPACK} or {JSON}, got {wire!r}")
        self.batch_size = batch_size
        self.max_in_flight = max_in_flight
        self.timeout_s = float(timeout_s)
        self.retries = retries
        self.backoff_s = float(backoff_s)
        self.fault_tolerant = bool(fault_tolerant)
        self.wait_s = float(wait_s)
        self.connect_timeout_s = float(connect_timeout_s)
        self.poll_s = float(poll_s)
        self.wire = wire
        self.requests_sent = 0  # POST /score attempts (tests, logs)
        self._states: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopState] = weakref.WeakKeyDictionary()

    def __repr__(self) -> str:
        return f"RemoteRewardClient({self.url!r}, {self.reward!r})"

    # ---- per-loop state ------------------------------------------------------------------------
    async def _state(self) -> _LoopState:
        loop = asyncio.get_running_loop()
        state = self._states.get(loop)
        if state is None or state.session.closed:
            session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
            closer = _close_at_loop_shutdown(session)
            await closer.__anext__()
            state = _LoopState(session, asyncio.Semaphore(self.max_in_flight), closer=closer)
            self._states[loop] = state
        return state

    async def aclose(self) -> None:
        """Close this event loop's session (the next call opens a new one)."""
        state = self._states.pop(asyncio.get_running_loop(), None)
        if state is not None:
            await state.closer.aclose()  # closes the session

    def _timeout(self, total: float) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=total, sock_connect=min(self.connect_timeout_s, total))

    # ---- health --------------------------------------------------------------------------------
    async def _get_health(self, session: aiohttp.ClientSession) -> dict[str, Any]:
        """One GET /health: the map, _Down when the service is not there, ConfigError when it is not one."""
        timeout_s = min(HEALTH_TIMEOUT_S, self.timeout_s)
        try:
            async with session.get(f"{self.url}/health", timeout=self._timeout(timeout_s)) as resp:
                body = await resp.read()
                status, content_type = resp.status, resp.headers.get("Content-Type")
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise _Down(self._cause(exc, timeout_s)) from exc
        try:
            answer = decode_response(body, content_type)
        except ProtocolError as exc:
            answer, problem = None, str(exc)
        else:
            problem = "" if status == 200 and answer.get("status") == "ok" else f"HTTP {status}: {answer!r:.200}"
        if answer is None or problem:
            raise ConfigError(
                f"{self.url}/health {problem}; is {self.url} a miles reward service (`miles reward serve`)?"
            )
        return answer

    def _check_answer(self, answer: Mapping[str, Any], *, reward: bool = True) -> dict[str, Any]:
        """The health map, checked: the protocol version, and (`reward`) that the service serves `self.reward`."""
        from miles import __version__

        version, rewards, theirs = answer.get("version"), answer.get("rewards"), answer.get("miles_version")
        served = ", ".join(map(str, rewards)) if isinstance(rewards, list) and rewards else "nothing"
        if version != PROTOCOL_VERSION:
            raise ConfigError(
                f"reward service {self.url} speaks protocol version {version!r} (miles {theirs}, serving {served}); "
                f"this miles {__version__} speaks version {PROTOCOL_VERSION}: run the same miles version on both sides"
            )
        if not isinstance(rewards, list):
            raise ConfigError(f"reward service {self.url} answered /health without its rewards: {answer!r:.200}")
        if reward and self.reward not in rewards:
            raise ConfigError(
                f"reward service {self.url} does not serve reward {self.reward!r}: it serves {served} (protocol "
                f"version {version}, miles {theirs}); start one with `miles reward serve --rm-type {self.reward}`"
            )
        return dict(answer)

    async def _health(self) -> dict[str, Any]:
        """GET /health, re-sent like a score request: unreachable -> RewardError (`fault_tolerant`: waited for)."""
        state = await self._state()
        tries = 0
        while True:
            tries += 1
            try:
                return await self._get_health(state.session)
            except _Down as exc:
                if self.fault_tolerant:
                    await self._wait_for_service(state, str(exc))
                    continue
                if tries > self.retries:
                    raise _reward_error(self._unreachable(str(exc), tries)) from None
            await asyncio.sleep(self._backoff(tries))

    async def check(self) -> dict[str, Any]:
        """GET /health at job start -> the service's health map. ConfigError (naming the URL, the service's
        rewards and version) when it speaks another protocol version or does not serve `reward`, or is not a
        reward service; RewardError when it is unreachable (with `fault_tolerant`: waited for up to `wait_s`)."""
        answer = self._check_answer(await self._health())
        self._checked = True
        return answer

    async def served(self) -> list[str]:
        """The names of the rewards the service serves (its /health; `reward` is not checked): RewardError when
        it is unreachable, ConfigError when it is not a reward service or speaks another protocol version."""
        answer = self._check_answer(await self._health(), reward=False)
        return [str(r) for r in answer["rewards"]]

    def check_sync(self) -> dict[str, Any]:
        """`check()` from synchronous code (no event loop running in this thread); its session is closed after."""

        async def run() -> dict[str, Any]:
            try:
                return await self.check()
            finally:
                await self.aclose()

        return asyncio.run(run())

    # ---- failures ------------------------------------------------------------------------------
    def _cause(self, exc: BaseException, timeout_s: float | None = None) -> str:
        if isinstance(exc, aiohttp.ConnectionTimeoutError if hasattr(aiohttp, "ConnectionTimeoutError") else ()):
            return f"no connection within {self.connect_timeout_s:g} s"
        if isinstance(exc, asyncio.TimeoutError):
            return f"no answer within {self.timeout_s if timeout_s is None else timeout_s:g} s"
        return _connect_cause(exc)

    def _unreachable(self, cause: str, tries: int) -> str:
        return (
            f"reward service {self.url} is unreachable ({cause}) after {tries} tr{'y' if tries == 1 else 'ies'}; "
            f"start it with `miles reward serve --rm-type {self.reward or 'REWARD'} ...` or pass "
            "--use-fault-tolerance to wait for it"
        )

    def _backoff(self, tries: int) -> float:
        return self.backoff_s * 2 ** (tries - 1)

    async def _wait_for_service(self, state: _LoopState, cause: str) -> None:
        """Wait (shared by every batch of this loop) until /health answers, at most `wait_s`; else RewardError."""
        if state.recovery is None or state.recovery.done():
            state.recovery = asyncio.ensure_future(self._poll_health(state, cause))
        await asyncio.shield(state.recovery)

    async def _poll_health(self, state: _LoopState, cause: str) -> None:
        logger.warning(
            "miles: reward service %s is down (%s); waiting up to %g s for it (--use-fault-tolerance)",
            self.url,
            cause,
            self.wait_s,
        )
        start = time.monotonic()
        deadline = start + self.wait_s
        while True:
            try:
                await self._get_health(state.session)
                logger.warning("miles: reward service %s is back after %.1f s", self.url, time.monotonic() - start)
                return
            except _Down as exc:
                cause = str(exc)
            except ConfigError:  # up, but answering something else (a proxy without its backend): still down
                pass
            left = deadline - time.monotonic()
            if left <= 0:
                raise _reward_error(
                    f"reward service {self.url} is unreachable ({cause}) and did not come back within "
                    f"{self.wait_s:g} s (--use-fault-tolerance waited for it); start it with "
                    f"`miles reward serve --rm-type {self.reward or 'REWARD'} ...`"
                )
            await asyncio.sleep(min(self.poll_s, left))

    # ---- scoring -------------------------------------------------------------------------------
    async def _post(self, state: _LoopState, body: bytes, count: int, names: Sequence[str]) -> list[float]:
        """One POST /score -> the rewards; _Down / _Transient for what a re-send may fix, else the final error."""
        self.requests_sent += 1
        try:
            async with state.session.post(
                f"{self.url}/score",
                data=body,
                headers={"Content-Type": self.wire, "Accept": self.wire},
                timeout=self._timeout(self.timeout_s),
            ) as resp:
                raw = await resp.read()
                status, content_type = resp.status, resp.headers.get("Content-Type")
        except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError) as exc:
            raise _Down(self._cause(exc)) from exc
        except TimeoutError as exc:  # aiohttp's connect timeout is one too
            connect = hasattr(aiohttp, "ConnectionTimeoutError") and isinstance(exc, aiohttp.ConnectionTimeoutError)
            raise (_Down if connect else _Transient)(self._cause(exc)) from exc
        except aiohttp.ClientError as exc:  # a reset connection, a broken answer
            raise _Down(self._cause(exc)) from exc
        try:
            answer = decode_response(raw, content_type)
        except ProtocolError as exc:
            if status >= 500:
                raise _Transient(f"HTTP {status}: {exc}") from None
            raise _reward_error(f"reward service {self.url} (HTTP {status}) {exc}") from None
        if status == 200:
            try:
                return read_rewards(answer, count)
            except ProtocolError as exc:
                raise _reward_error(f"reward service {self.url} {exc} ({_describe(names)})") from None
        error = one_line(str(answer.get("error") or f"HTTP {status} without a message"))
        if status == 404:
            raise ConfigError(f"reward service {self.url}: {error}")
        if status >= 500 and answer.get("retryable", True) is not False:
            raise _Transient(f"HTTP {status}: {error}")
        if status >= 500:
            raise _reward_error(f"{error} (reward service {self.url})")
        raise _reward_error(f"reward service {self.url} refused the request (HTTP {status}): {error}")

    async def _score_batch(
        self,
        state: _LoopState,
        images: Sequence[Any],
        prompts: Sequence[str],
        metadata: Sequence[Mapping[str, Any]],
        names: Sequence[str],
    ) -> list[float]:
        async with state.semaphore:
            try:  # PNG encoding is CPU work: off the event loop
                body = await asyncio.to_thread(
                    encode_request, self.reward, images, prompts, metadata, names, self.wire
                )
            except ValueError as exc:
                raise _reward_error(f"remote reward {self.reward!r}: cannot send {exc}") from exc
            tries = 0
            outages = 0
            while True:
                tries += 1
                try:
                    return await self._post(state, body, len(images), names)
                except _Down as exc:
                    if self.fault_tolerant:
                        outages += 1
                        if outages > self.retries + 1:
                            raise _reward_error(
                                f"reward service {self.url} went down {outages} times while scoring "
                                f"{_describe(names)} ({exc}); these items may be what brings it down"
                            ) from None
                        await self._wait_for_service(state, str(exc))
                        tries = 0
                        continue
                    if tries > self.retries:
                        raise _reward_error(self._unreachable(str(exc), tries)) from None
                    failure: Exception = exc
                except _Transient as exc:
                    if tries > self.retries:
                        raise _reward_error(
                            f"reward service {self.url} failed on {_describe(names)} after {tries} tries: {exc}"
                        ) from None
                    failure = exc
                logger.info("miles: reward service %s: %s; re-sending (try %d)", self.url, failure, tries + 1)
                await asyncio.sleep(self._backoff(tries))

    async def score(
        self,
        images: Sequence[Any],
        prompts: Sequence[str],
        metadata: Sequence[Mapping[str, Any]],
        names: Sequence[str] | None = None,
    ) -> list[float]:
        """One reward per item, in order. `images`: `[3, H, W]` images / `[3, F, H, W]` videos (float in [0, 1]
        or uint8, tensors, arrays or PIL images); `names` (one line each, default "sample i (prompt ...)") name
        the items in errors. RewardError (one line) when scoring fails; ConfigError when the reward is not served."""
        n = len(images)
        if len(prompts) != n or len(metadata) != n or (names is not None and len(names) != n):
            lengths = f"{n} images, {len(prompts)} prompts, {len(metadata)} metadata"
            raise ValueError(lengths + ("" if names is None else f", {len(names)} names"))
        if n == 0:
            return []
        if names is None:
            names = [describe_sample(i, str(p)) for i, p in enumerate(prompts)]
        names = list(names)
        if not self._checked:
            await self.check()
        state = await self._state()
        size = self.batch_size
        tasks = [
            asyncio.ensure_future(
                self._score_batch(
                    state, images[a : a + size], prompts[a : a + size], metadata[a : a + size], names[a : a + size]
                )
            )
            for a in range(0, n, size)
        ]
        try:
            _, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        except BaseException:  # cancelled: take the batches down with us
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        if pending:  # one batch failed: the others are not worth finishing
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        return [value for task in tasks for value in task.result()]

    async def score_samples(self, samples: Sequence[Sample]) -> list[float]:
        """`score` for rollout samples (`sample.image`, `.prompt`, `.metadata`), named as the dispatch names them."""
        names = [describe_sample(s.index, s.prompt) for s in samples]
        for s, name in zip(samples, names, strict=True):
            if s.image is None:
                raise _reward_error(f"reward {self.reward!r} (remote, {self.url}): {name} has no image")
        return await self.score(
            [s.image for s in samples], [s.prompt for s in samples], [dict(s.metadata or {}) for s in samples], names
        )
