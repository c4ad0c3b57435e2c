"""Score microgroups while the engines generate the rest of the rollout.

    with StreamingScorer(args) as scorer:
        for samples in microgroups_as_they_finish():
            scorer.submit(samples)          # returns at once; scoring runs on a background event loop
    # leaving the block waits for every submitted microgroup (and raises the first reward error)

The diffusers engines' path (`RolloutManager.run_requests`, with and without the engine supervisor) hands each
microgroup over as soon as its Ray call returns, so only the last microgroup's scoring is left when generation ends
(`perf/reward_time` measures that tail). The sglang path scores inside its own event loop the same way. Under
`--group-rm` a group is scored whole, after generation.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Sequence
from types import TracebackType
from typing import Any

from miles.core.sample import Sample


class StreamingScorer:
    """A background event loop scoring submitted samples with `score_samples` (rewards set on the samples)."""

    def __init__(self, args: Any) -> None:
        self.args = args
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="miles-streaming-score", daemon=True)
        self._thread.start()
        self._futures: list[concurrent.futures.Future[Any]] = []

    def submit(self, samples: Sequence[Sample]) -> None:
        """Start scoring `samples` (those with no reward yet); returns at once."""
        from miles.rewards.dispatch import score_samples

        todo = [s for s in samples if s.reward is None]
        if todo:
            self._futures.append(asyncio.run_coroutine_threadsafe(score_samples(self.args, todo), self._loop))

    def wait(self) -> None:
        """Wait for every submitted batch; the first failure is raised (the others are still awaited)."""
        error: BaseException | None = None
        for future in self._futures:
            try:
                future.result()
            except BaseException as exc:  # re-raised below, after the rest finished
                error = error or exc
        self._futures.clear()
        if error is not None:
            raise error

    def close(self) -> None:
        for future in self._futures:
            future.cancel()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> StreamingScorer:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        try:
            if kind is None:
                self.wait()
        finally:
            self.close()
