"""The driver side of owning failures: what an error caught from Ray means, said in one line.

`explain(exc, log_dir)` walks what Ray raised (a task error wraps the actor's exception as `.cause`, nested when
one actor called another; an actor that died carries its id; one whose constructor raised carries only text)
and the run's actor registry (`<output-dir>/logs/actors.jsonl`, written by `miles.utils.actors`) to find the
actor at the bottom and what it said:
- a user mistake found inside an actor (ConfigError, a hook's error) -> the same one line, exit 2;
- an error that already says everything in one line (an engine failure, a reward error, a hook past
  --hook-timeout) -> that line with the actor's log, exit 1;
- anything else, or an actor's death -> role, index, node, pid, the exception's last line and the log, exit 1.
Torch-free.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles.utils.actors import REGISTRY
from miles.utils.text import bounded

# Classes whose message is a user's mistake, said as one line (exit 2).
USER_ERRORS = (
    "miles.core.errors.ConfigError",
    "miles.training.custom_hooks.HookError",
    "miles.rollout.rollout_hooks.RolloutHookError",
)
# Classes whose message already names what failed and where (exit 1, the line as it is).
ONE_LINE_ERRORS = (
    "miles.core.errors.EngineFailure",
    "miles.rollout.engines.supervisor.DiffusersEngineError",
    "miles.rollout.engines.sglang.rollout.RolloutEngineError",
    "miles.rewards.errors.RewardError",
    "miles.utils.deadline.HookTimeout",
    "miles.utils.disk.DiskFull",
)
_HEADER = re.compile(r"ray::([\w.<>]+)\(\)\S*\s*\(pid=(\d+), ip=([^,)]+)(?:, actor_id=(\w+))?")


@dataclass(frozen=True)
class Failure:
    code: int  # 2: a user's mistake; 1: a runtime failure
    line: str


@dataclass
class _Found:
    type_name: str | None = None  # module.qualname of the innermost exception
    message: str = ""
    pid: int | None = None
    node: str | None = None
    actor_id: str | None = None
    died: bool = False
    exc: BaseException | None = None


def read_registry(log_dir: str | Path | None) -> list[dict[str, Any]]:
    if log_dir is None:
        return []
    path = Path(log_dir) / REGISTRY
    records: list[dict[str, Any]] = []
    try:
        with path.open(encoding="utf-8", errors="replace") as handle:
            for line in handle:
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    except OSError:
        return []
    return records


def _qualname(exc: BaseException) -> str:
    cls = type(exc)
    for klass in cls.__mro__:  # Ray's dual classes `RayTaskError(X)` subclass X: name X
        if not klass.__module__.startswith("ray."):
            return f"{klass.__module__}.{klass.__qualname__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def _last_line(text: str) -> str:
    lines = [line.strip() for line in str(text).strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _is_a(type_name: str | None, names: tuple[str, ...]) -> bool:
    if type_name is None:
        return False
    return type_name in names or any(type_name.endswith("." + n.rsplit(".", 1)[1]) for n in names)


def _walk(exc: BaseException) -> _Found:
    """The innermost actor-side exception under `exc`, with the pid/node/actor id of the actor it came from."""
    import ray.exceptions as rex

    found = _Found()
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, rex.RayTaskError):
            header = _HEADER.search(str(current))
            if header:
                found.pid, found.node = int(header.group(2)), header.group(3)
                found.actor_id = header.group(4) or found.actor_id
            cause = getattr(current, "cause", None)
            if cause is None or cause is current:
                found.type_name, found.message, found.exc = None, _last_line(str(current)), current
                break
            current = cause
            continue
        if isinstance(current, rex.RayActorError):
            found.died = True
            found.actor_id = getattr(current, "actor_id", None) or found.actor_id
            text = str(getattr(current, "error_msg", "") or current)
            header = _HEADER.search(text)
            if header:
                found.pid, found.node = int(header.group(2)), header.group(3)
                found.actor_id = header.group(4) or found.actor_id
            found.exc, found.message, found.type_name = current, _creation_error(text) or _death_reason(text), None
            if _creation_error(text):
                found.died = False
                found.type_name = _creation_type(text)
            break
        found.exc, found.type_name, found.message = current, _qualname(current), _last_line(str(current))
        nested = current.__cause__
        if nested is None or not _is_ray_error(nested):
            break
        current = nested
    return found


def _is_ray_error(exc: BaseException) -> bool:
    return type(exc).__module__.startswith("ray.") or any(k.__module__.startswith("ray.") for k in type(exc).__mro__)


_CREATION = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Failure|Timeout)): (.+)$", re.MULTILINE)


def _creation_error(text: str) -> str | None:
    """The message of the exception a constructor raised, from the text of the ActorDiedError Ray made of it."""
    if "creation task" not in text:
        return None
    matches = _CREATION.findall(text)
    return matches[-1][1].strip() if matches else None


def _creation_type(text: str) -> str | None:
    matches = _CREATION.findall(text)
    return matches[-1][0] if matches else None


def _death_reason(text: str) -> str:
    """What Ray says of an actor's death, in a few words (its text lists causes it cannot tell apart)."""
    if re.search(r"low on memory|memory monitor|OutOfMemoryError", text, re.IGNORECASE):
        return "was killed by Ray's memory monitor (the node ran low on memory)"
    if re.search(r"ray\.kill|killed by `?ray\.kill", text):
        return "was killed (ray.kill)"
    if re.search(r"creation task", text):
        return "failed to start"
    if re.search(r"Worker exit type: (SYSTEM_ERROR|NODE_OUT_OF_MEMORY)|connection error|End of file", text):
        return "died: its process ended unexpectedly (killed by a signal, the kernel's OOM killer, or a crash)"
    if re.search(r"Worker exit type: INTENDED_USER_EXIT|exit\(\)", text):
        return "exited (the actor's own code ended its process)"
    if re.search(r"node .*(died|dead)|NodeDiedError", text, re.IGNORECASE):
        return "died with its node"
    return "died"


def _lookup(records: list[dict[str, Any]], found: _Found) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(the actor's start record, its last error record) in the registry, by actor id, else by pid."""
    start = last = None
    for record in records:
        same = (found.actor_id and record.get("actor_id") == found.actor_id) or (
            found.pid is not None and record.get("pid") == found.pid and not found.actor_id
        )
        if not same:
            continue
        if record.get("event") == "start":
            start = record
        elif record.get("event") == "error":
            last = record
    return start, last


def explain(exc: BaseException, log_dir: str | Path | None) -> Failure | None:
    """One line for what Ray raised (see the module docstring); None when `exc` is not from an actor."""
    if not _is_ray_error(exc):
        return None
    found = _walk(exc)
    records = read_registry(log_dir)
    start, last = _lookup(records, found)
    type_name, message = found.type_name, found.message
    if last is not None and (found.died or type_name is None or not message):
        type_name, message = last.get("type"), str(last.get("message") or message)
    if last is not None and found.died and _is_a(last.get("type"), ONE_LINE_ERRORS):
        type_name, message = last.get("type"), str(last.get("message"))
    who = _who(start, found)
    log = f"; full log: {start['log']}" if start and start.get("log") else _log_hint(log_dir)
    if _is_a(type_name, USER_ERRORS):
        return Failure(2, message)
    if _is_a(type_name, ONE_LINE_ERRORS):  # the message names what failed; the logs of every actor are beside
        return Failure(1, f"{message} (logs: {log_dir})" if log_dir else message)
    if found.died and (last is None or last.get("type") is None):
        words = _last_words(start.get("log")) if last is None and start else None
        return Failure(1, f"{who} {message}{f'; its log ends with: {words}' if words else ''}{log}")
    short = (type_name or "error").rsplit(".", 1)[-1]
    return Failure(1, f"{who} failed: {short}: {message}{log}")


# what a process that ended abruptly leaves at the end of its log, the most telling first
_LAST_WORDS = (
    re.compile(r"^Fatal Python error: (.+)$", re.MULTILINE),  # faulthandler: a signal or an abort in C
    re.compile(r"^terminate called after throwing an instance of (.+)$", re.MULTILINE),  # C++
    re.compile(r"^\s*what\(\):\s*(.+)$", re.MULTILINE),
)


def _last_words(log: str | None, size: int = 65536) -> str | None:
    """What the log of an actor that died says of the crash (faulthandler's fatal error, a C++ exception's
    type and what()), in one line; None when its end says nothing of it."""
    if not log:
        return None
    try:
        with open(log, "rb") as handle:
            handle.seek(0, 2)
            handle.seek(max(0, handle.tell() - size))
            tail = handle.read().decode("utf-8", errors="replace")
    except OSError:
        return None
    found = []
    for pattern in _LAST_WORDS:
        matches = pattern.findall(tail)
        if matches:
            found.append(matches[-1].strip()[:300])
    return "; ".join(found) or None


def _who(start: dict[str, Any] | None, found: _Found) -> str:
    if start is not None:
        return f"{start['role']} {start['index']} on node {start.get('node')} (pid {start.get('pid')})"
    where = f" on node {found.node}" if found.node else ""
    pid = f" (pid {found.pid})" if found.pid else ""
    return f"an actor{where}{pid}"


def _log_hint(log_dir: str | Path | None) -> str:
    return f"; logs: {log_dir}" if log_dir else ""


def host_lost_line(lost: Any, args: Any) -> str:
    """The failure line of a lost host (`miles.runtime.host_watch.HostLost`): where a rerun resumes, the logs."""
    from miles.runtime.signals import last_checkpoint_line
    from miles.utils.actors import logs_dir

    log_dir = logs_dir(args) if args.output_dir else None
    return f"{lost.line}; {last_checkpoint_line(args)}{_log_hint(log_dir)}"


def _disk_full_line(exc: BaseException) -> str | None:
    """The line of a write that ran out of space in the driver: the `DiskFull` (or ENOSPC error) it raised."""
    from miles.utils.disk import DiskFull, is_disk_full

    if isinstance(exc, DiskFull):
        return str(exc)
    if isinstance(exc, OSError) and is_disk_full(exc):
        return str(DiskFull(exc.filename or "a file")) if exc.filename else f"no space left on device: {exc}"
    return None


def report_failure(exc: BaseException, args: Any) -> int:
    """Say `exc` in one line on the terminal (its traceback goes to logs/driver.log) and return the exit code;
    a user's mistake found inside an actor is raised again as the ConfigError it was (exit 2)."""
    import sys
    import traceback

    import miles.runtime.host_watch as host_watch
    from miles.core.errors import ConfigError, find_engine_failure
    from miles.runtime.terminal import write_driver_log
    from miles.utils.actors import logs_dir

    log_dir = logs_dir(args) if args.output_dir else None
    write_driver_log("".join(traceback.format_exception(exc)))
    lost = host_watch.lost()  # a lost host is the cause, whichever of its actors' errors arrived first
    failure = explain(exc, log_dir)
    if lost is not None and (failure is None or failure.code != 2):  # a user's mistake is said as it is
        failure = Failure(1, host_lost_line(lost, args))
    if failure is None:
        engine = find_engine_failure(exc)
        full = _disk_full_line(exc)
        if full is not None:  # the driver's own write ran out of space
            failure = Failure(1, full)
        elif engine is not None:
            failure = Failure(1, engine)
        else:
            where = f"; traceback in {log_dir / 'driver.log'}" if log_dir else ""
            failure = Failure(1, f"the driver failed: {type(exc).__name__}: {_last_line(str(exc))}{where}")
    if failure.code == 2:
        raise ConfigError(failure.line) from None
    print(f"miles: error: {bounded(failure.line)}", file=sys.stderr, flush=True)
    return failure.code
