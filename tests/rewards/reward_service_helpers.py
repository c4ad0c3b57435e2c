"""The reward service tests' parts: cheap scorers, a service in a background thread, and a service in a
subprocess (run as a script: `python reward_service_helpers.py --port P --ready-file F [--delay S]`), for the
tests that kill it."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


# ---- scorers -----------------------------------------------------------------------------------
def mean_pixel(images: Sequence[Any], prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]) -> list[float]:
    """A pure scorer: each image's mean value (float64), as the image is handed over (uint8 or float)."""
    return [float(np.asarray(im, dtype=np.float64).mean()) for im in images]


class CountingScorer:
    """`mean_pixel`, recording the size of every call; `delay` seconds per call; raises on `metadata.bad`."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.sizes: list[int] = []
        self._lock = threading.Lock()

    def __call__(self, images, prompts, metadata) -> list[float]:
        with self._lock:
            self.sizes.append(len(images))
        if self.delay:
            time.sleep(self.delay)
        for meta in metadata:
            if meta.get("bad"):
                raise ValueError(f"bad item {meta['bad']!r}")
        return mean_pixel(images, prompts, metadata)


def grid_images(n: int, seed: int = 0, size: int = 16) -> list[np.ndarray]:
    """`n` float32 `[3, H, W]` images on the uint8 grid (`u / 255`): what the service hands a scorer, exactly."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (3, size, size), dtype=np.uint8).astype(np.float32) / 255 for _ in range(n)]


# ---- a service in a thread ---------------------------------------------------------------------
class ServiceThread:
    """An aiohttp app served on 127.0.0.1 (a free port) by an event loop in a daemon thread."""

    def __init__(self, app: Any) -> None:
        from aiohttp import web

        self.app = app
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="reward-service", daemon=True)
        self.thread.start()

        async def start() -> str:
            self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
            await self.runner.setup()
            await web.TCPSite(self.runner, "127.0.0.1", 0).start()
            return f"http://127.0.0.1:{self.runner.addresses[0][1]}"

        self.url = self.run(start())

    def run(self, coro: Any, timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.run(self.runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---- a service in a subprocess -----------------------------------------------------------------
class ServiceProcess:
    """`mean_pixel` (as reward `mean_pixel`, `delay` s per scorer call) served by a child process on `port`."""

    def __init__(self, port: int, ready_file: Path, delay: float = 0.0, timeout: float = 30.0) -> None:
        ready_file.unlink(missing_ok=True)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        cmd = [sys.executable, __file__, "--port", str(port), "--ready-file", str(ready_file), "--delay", str(delay)]
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + timeout
        while not ready_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                out = self.proc.communicate(timeout=5)[0] if self.proc.poll() is not None else "(still running)"
                self.kill()
                raise RuntimeError(f"the reward service did not start: {out}")
            time.sleep(0.02)
        self.url = ready_file.read_text().strip()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def main() -> None:
    from miles.rewards.service.server import run_service

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--ready-file", required=True)
    parser.add_argument("--delay", type=float, default=0.0)
    args = parser.parse_args()
    scorers = {"mean_pixel": CountingScorer(args.delay)}
    asyncio.run(run_service(scorers, "127.0.0.1", args.port, ready_file=args.ready_file, max_batch_size=8))


if __name__ == "__main__":
    main()
