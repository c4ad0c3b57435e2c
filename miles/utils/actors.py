"""The actor side of owning failures: every Ray actor a job starts is made by `actor_class` and started with
an `ActorTag` (role, index, the run's `logs/` folder).

In its process the tag
- sends fd 1 and 2 to `<output-dir>/logs/<role>-<index>.log` (tracebacks, library chatter, C-level writes),
  while lines that start with ``miles: `` (what a user must see: an engine ready, a restart) also go to the
  stream Ray forwards to the driver, which shows only those (`miles.runtime.terminal`);
- registers the actor in `<output-dir>/logs/actors.jsonl` (role, index, node, pid, actor id, log path), so the
  driver can name any actor that failed, wherever it was started (the rollout manager starts the engines);
- writes every exception a method raises to the log with its traceback, and records it as the actor's last
  words in the registry, before Ray carries it to the caller (an actor whose constructor raised reaches the
  driver only as text; the last words keep its class and message);
- sets the hook deadline (`--hook-timeout`) for the user hooks it runs (`miles.utils.deadline`).

Torch-free; Ray is imported only inside the actor. (In `utils`, since every layer starts actors.)
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import io
import json
import os
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REGISTRY = "actors.jsonl"
USER_LINE = "miles: "  # lines an actor prints that the user sees on the terminal too


@dataclass(frozen=True)
class ActorTag:
    role: str  # actor, critic, engine, rollout_manager, reward, router, poster, ...
    index: int
    log_dir: str  # <output-dir>/logs
    verbose: bool = False  # --verbose: keep Ray's streams as they are (everything reaches the terminal)
    hook_timeout: float | None = None  # --hook-timeout
    host_timeout: float | None = None  # --host-timeout: cut off from the Ray head this long, the actor exits

    @property
    def name(self) -> str:
        return f"{self.role} {self.index}"

    @property
    def log_path(self) -> Path:
        return Path(self.log_dir) / f"{self.role}-{self.index}.log"


def logs_dir(args: Any) -> Path:
    return Path(str(getattr(args, "output_dir", None) or ".")) / "logs"


def tag_for(args: Any, role: str, index: int = 0) -> ActorTag | None:
    """The tag of an actor of the job `args` describes (None without an output dir: a bare actor in a test)."""
    if not getattr(args, "output_dir", None):
        return None
    timeout = getattr(args, "hook_timeout", None)
    return ActorTag(
        role=role,
        index=int(index),
        log_dir=str(logs_dir(args).resolve()),
        verbose=bool(getattr(args, "verbose", False)),
        hook_timeout=float(timeout) if timeout else None,
        host_timeout=float(getattr(args, "host_timeout", None) or 0) or None,
    )


class _ActorStream(io.TextIOBase):
    """sys.stdout / sys.stderr of an actor: every line to the log, ``miles: `` lines also to Ray's stream."""

    def __init__(self, log: Any, terminal: Any) -> None:
        self._log, self._terminal, self._pending = log, terminal, ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self._log.write(text)
        self._pending += text
        while "\n" in self._pending:
            line, self._pending = self._pending.split("\n", 1)
            if line.startswith(USER_LINE):
                self._terminal.write(line + "\n")
                self._terminal.flush()
        if len(self._pending) > 65536:  # no newline in sight: never show a partial line, never grow unbounded
            self._pending = ""
        self._log.flush()
        return len(text)

    def flush(self) -> None:
        self._log.flush()
        self._terminal.flush()

    def fileno(self) -> int:
        return self._log.fileno()

    def isatty(self) -> bool:
        return False


_CURRENT: ActorTag | None = None


def log_hint() -> str:
    """`` (traceback in <log>)`` inside an actor, else empty: for one-line errors whose traceback is worth reading."""
    return f" (traceback in {_CURRENT.log_path})" if _CURRENT is not None else ""


def start_actor(tag: ActorTag) -> None:
    """Called first in an actor's process (by the class `actor_class` makes): logs, registry, deadlines."""
    global _CURRENT
    _CURRENT = tag
    from miles.utils import deadline

    deadline.set_hook_timeout(tag.hook_timeout)
    deadline.on_expire = _expire
    tag.log_path.parent.mkdir(parents=True, exist_ok=True)
    if not tag.verbose:
        sys.stdout.flush()
        sys.stderr.flush()
        ray_stream = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8", errors="replace")
        fd = os.open(tag.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        log = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8", errors="replace")
        sys.stdout = _ActorStream(log, ray_stream)
        sys.stderr = _ActorStream(log, ray_stream)
        _log_warnings_to_both()
    import faulthandler

    faulthandler.enable(all_threads=True)  # a crash in C leaves its stacks in the log
    with tag.log_path.open("a", encoding="utf-8") as log_file:  # the log exists under --verbose too
        log_file.write(f"[{tag.name}] started: pid {os.getpid()}\n")
    _register(tag, {"event": "start"})
    if tag.host_timeout:
        from miles.utils import lifeline

        lifeline.start(tag.host_timeout, tag.name, on_exit=_cut_off)


def _log_warnings_to_both() -> None:
    """miles' own logged warnings in an actor: to its log and, as ``miles: warning: ...`` lines, to the terminal."""
    import logging

    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter(USER_LINE + "warning: %(message)s"))
    miles_logger = logging.getLogger("miles")
    miles_logger.addHandler(handler)
    miles_logger.propagate = False


def _expire(message: str) -> None:
    """A hook ran past --hook-timeout in this actor: its stacks to the log, last words, end the process."""
    import faulthandler

    tag = _CURRENT
    print(f"[{tag.name if tag else 'actor'}] {message}; the stacks of its threads:", file=sys.stderr, flush=True)
    faulthandler.dump_traceback(all_threads=True)
    if tag is not None:
        kind = "miles.utils.deadline.HookTimeout"
        _register(tag, {"event": "error", "where": "hook", "type": kind, "message": message})
    os._exit(1)


def _cut_off(reason: str) -> None:
    """The lifeline's last words: the driver's line reads '<actor> exited: <reason>'."""
    if _CURRENT is not None:
        _register(_CURRENT, {"event": "error", "where": "lifeline", "type": None, "message": f"exited: {reason}"})


def _register(tag: ActorTag, record: dict[str, Any]) -> None:
    """One line of the run's actor registry (an O_APPEND write of one line: whole even with many writers)."""
    try:
        import ray

        context = ray.get_runtime_context()
        actor_id, node = context.get_actor_id(), ray.util.get_node_ip_address()
    except Exception:
        actor_id, node = None, None
    line = {
        "role": tag.role,
        "index": tag.index,
        "pid": os.getpid(),
        "node": node,
        "actor_id": actor_id,
        "log": str(tag.log_path),
        **record,
    }
    data = (json.dumps(line, default=str) + "\n").encode()
    fd = os.open(Path(tag.log_dir) / REGISTRY, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def record_failure(exc: BaseException, where: str) -> None:
    """Write `exc` with its traceback to this actor's log and register it as the actor's last words."""
    tag = _CURRENT
    if tag is None:
        return
    text = "".join(traceback.format_exception(exc))
    print(f"[{tag.name}] {where} raised:\n{text}", file=sys.stderr, flush=True)
    message = (str(exc).strip().splitlines() or [""])[-1]
    kind = f"{type(exc).__module__}.{type(exc).__qualname__}"
    with contextlib.suppress(OSError):
        _register(tag, {"event": "error", "where": where, "type": kind, "message": message[:2000]})


def _wrap_method(name: str, fn: Any) -> Any:
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def async_method(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return await fn(self, *args, **kwargs)
            except Exception as exc:
                record_failure(exc, name)
                raise

        return async_method

    @functools.wraps(fn)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(self, *args, **kwargs)
        except Exception as exc:
            record_failure(exc, name)
            raise

    return method


_CLASSES: dict[type, type] = {}


def actor_class(cls: type) -> type:
    """A subclass of `cls` whose constructor takes `_miles_tag=ActorTag(...)` (started first) and whose public
    methods record what they raise. Pass the result to `ray.remote`."""
    if cls in _CLASSES:
        return _CLASSES[cls]
    namespace: dict[str, Any] = {}
    for klass in reversed(cls.__mro__[:-1]):
        for name, value in vars(klass).items():
            if name.startswith("_") or not inspect.isfunction(value):
                continue
            namespace[name] = _wrap_method(f"{cls.__name__}.{name}", value)
    original_init = cls.__init__

    def __init__(self: Any, *args: Any, _miles_tag: ActorTag | None = None, **kwargs: Any) -> None:
        if _miles_tag is not None:
            start_actor(_miles_tag)
        try:
            original_init(self, *args, **kwargs)
        except Exception as exc:
            record_failure(exc, f"{cls.__name__}.__init__")
            raise
        from miles.utils.gc_pauses import freeze_startup_objects

        freeze_startup_objects()  # what the constructor built lives as long as the actor: out of GC's walks

    namespace["__init__"] = __init__
    namespace["__module__"] = cls.__module__
    namespace["__qualname__"] = cls.__qualname__
    wrapped = type(cls.__name__, (cls,), namespace)
    _CLASSES[cls] = wrapped
    return wrapped


def owned_remote(cls: type, **remote_options: Any) -> Any:
    """`ray.remote(actor_class(cls))`, with `remote_options` (e.g. concurrency_groups) when given."""
    import ray

    wrapped = actor_class(cls)
    return ray.remote(**remote_options)(wrapped) if remote_options else ray.remote(wrapped)
