"""A driver killed with SIGKILL leaves no Ray process of its job behind.

The driver starts this as a small process (`start_reaper`) right after it started its local Ray cluster, with
the read end of a pipe as its stdin; the driver holds the write end and never writes. Every second the reaper
notes the cluster's processes (those whose command line names the session directory, and everything below
them: workers, agents). The pipe reaches EOF when the driver exits however it exits; a driver that shut Ray
down cleanly has left nothing to find, and after one that was killed the reaper sends SIGTERM, then SIGKILL to
what is still there after 2 s, and exits.

Linux (/proc) only; elsewhere it is not started. Torch-free and Ray-free.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

_PROC = Path("/proc")


def _start_time(pid: int) -> str | None:
    try:
        stat = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22: starttime (after the comm field in parentheses)


def _ppid(pid: int) -> int | None:
    try:
        stat = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


def session_processes(session_dir: str, exclude: set[int]) -> dict[int, str]:
    """pid -> start time of the processes of the Ray session at `session_dir` and their descendants."""
    pids = [int(p.name) for p in _PROC.iterdir() if p.name.isdigit()]
    roots: set[int] = set()
    parents: dict[int, int] = {}
    needle = session_dir.encode()
    for pid in pids:
        if pid in exclude:
            continue
        try:
            cmdline = (_PROC / str(pid) / "cmdline").read_bytes()
        except OSError:
            continue
        if needle in cmdline:
            roots.add(pid)
        ppid = _ppid(pid)
        if ppid is not None:
            parents[pid] = ppid
    found = set(roots)
    changed = True
    while changed:
        changed = False
        for pid, ppid in parents.items():
            if ppid in found and pid not in found and pid not in exclude:
                found.add(pid)
                changed = True
    return {pid: start for pid in found if (start := _start_time(pid)) is not None}


def _signal_all(known: dict[int, str], sig: int) -> int:
    sent = 0
    for pid, start in known.items():
        if _start_time(pid) == start:  # the same process, not a reused pid
            try:
                os.kill(pid, sig)
                sent += 1
            except OSError:
                pass
    return sent


def reap(session_dir: str, driver_pid: int, poll_s: float = 1.0) -> int:
    """Watch stdin for EOF (the driver gone), then end the session's processes; the number signalled."""
    me = {os.getpid(), driver_pid}
    known: dict[int, str] = {}
    while True:
        readable, _, _ = select.select([sys.stdin.buffer], [], [], poll_s)
        if readable and not sys.stdin.buffer.read1(4096):
            break
        known.update(session_processes(session_dir, me))
    known.update(session_processes(session_dir, me))
    sent = _signal_all(known, signal.SIGTERM)
    if sent:
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and any(_start_time(p) == s for p, s in known.items()):
            time.sleep(0.1)
        _signal_all(known, signal.SIGKILL)
    return sent


_PIPE_W: int | None = None


def start_reaper(session_dir: str) -> subprocess.Popen | None:
    """Start the reaper of the Ray session at `session_dir` (this process must be its driver)."""
    global _PIPE_W
    if not _PROC.is_dir():
        return None
    read_end, write_end = os.pipe()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "miles.runtime.reaper", session_dir, str(os.getpid())],
            stdin=read_end,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C of the terminal's process group does not reach it
        )
    finally:
        os.close(read_end)
    if _PIPE_W is not None:
        os.close(_PIPE_W)
    _PIPE_W = write_end  # not inheritable: only this process holds it, so its death is the EOF
    return proc


if __name__ == "__main__":
    reap(sys.argv[1], int(sys.argv[2]))
