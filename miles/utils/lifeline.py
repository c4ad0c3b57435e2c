"""An actor's lifeline to the Ray head: an actor cut off from it for `--host-timeout` seconds exits.

A host whose link goes down keeps its raylet and the job's actors running: Ray's head declares the node dead
after its own timeout, but nobody can reach those processes to end them, and they would go on holding GPUs (and
sglang servers) after the job has ended. Each actor of a job therefore checks, every second, that the head's
GCS port still accepts a TCP connection (answered by the head's kernel, so a busy head is not a silent one); after
`timeout` seconds without one, and three failed probes in a row (`Watch`), it writes why to its log, registers it
as its last words for the driver's failure line, and exits (an sglang server it started dies with it).
Torch-free; Ray is asked only for the head's address.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
from collections.abc import Callable


def _reachable(host: str, port: int, timeout: float) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def head_address() -> tuple[str, int] | None:
    try:
        import ray

        address = ray.get_runtime_context().gcs_address
    except Exception:
        return None
    host, _, port = str(address).rpartition(":")
    host = host.strip("[]")  # an IPv6 literal
    return (host, int(port)) if host and port.isdigit() else None


def _on_the_head() -> bool:
    """Whether this actor runs on the head's own node (one host, a laptop): it cannot be cut off from it."""
    try:
        import ray

        return ray.util.get_node_ip_address() == (head_address() or ("",))[0]
    except Exception:
        return False


class Watch:
    """When a lifeline gives up: `timeout` seconds since the head last answered, and at least `probes` failed
    probes in a row since. A process starved of CPU for longer than the timeout (a loaded machine) wakes to a
    long gap, not to a cut-off: one failed probe after it is not enough."""

    def __init__(self, timeout: float, now: float, probes: int = 3) -> None:
        self.timeout, self.probes = timeout, probes
        self.last_answer, self.failed = now, 0

    def observe(self, answered: bool, now: float) -> bool:
        """Record one probe at `now`; True when the head is to be taken as lost."""
        if answered:
            self.last_answer, self.failed = now, 0
            return False
        self.failed += 1
        return self.failed >= self.probes and now - self.last_answer > self.timeout


def start(
    timeout: float, name: str, interval: float = 1.0, on_exit: Callable[[str], None] | None = None
) -> threading.Thread | None:
    """Watch the head from a daemon thread; None when this process is not in a Ray cluster or runs on the head's
    node (every actor of a one-host job: no thread, no connection). `on_exit(reason)` runs before the exit (the
    actor registers its last words with it)."""
    address = head_address()
    if address is None or _on_the_head():
        return None

    def watch() -> None:
        state = Watch(timeout, time.monotonic())
        while True:
            time.sleep(interval)
            answered = _reachable(*address, timeout=min(interval, 2.0))
            if state.observe(answered, time.monotonic()):
                reason = (
                    f"the Ray head {address[0]}:{address[1]} has been unreachable for {timeout:g} s "
                    "(--host-timeout): this host is cut off from the job"
                )
                print(f"[{name}] {reason}; exiting", file=sys.stderr, flush=True)
                if on_exit is not None:
                    with contextlib.suppress(Exception):  # the exit happens whatever the last words do
                        on_exit(reason)
                os._exit(1)

    thread = threading.Thread(target=watch, name="miles-lifeline", daemon=True)
    thread.start()
    return thread
