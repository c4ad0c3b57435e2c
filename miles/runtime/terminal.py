"""A quiet terminal: Ray's own output and the actors' go to the run's `logs/`, unless --verbose.

Set up in the driver before `ray.init` (`quiet_ray`):
- Ray's loggers (the token-authentication notice, "Started a local Ray instance", ...) write to
  `<output-dir>/logs/driver.log` instead of the terminal;
- what Ray forwards from the actors and the raylet (worker output, "N PYTHON worker processes have been
  started", "A worker died ...", "[repeated Nx across cluster]") is written to driver.log too, and only the
  lines an actor means for the user (``miles: ...``, see `miles.utils.actors`) reach the terminal.
The actors send their own stdout/stderr to `logs/<role>-<index>.log` (`miles.utils.actors.start_actor`).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from pathlib import Path
from typing import Any

from miles.utils.actors import USER_LINE

_LOCK = threading.Lock()
_DRIVER_LOG: Path | None = None
_LOG_FAILED = False  # driver.log could not be written (a full disk): nothing more is tried


def _append(lines: list[str]) -> None:
    """Append to driver.log; never raises: a log that cannot be written (a full disk) is said once on stderr
    and left, so that reporting a failure never needs the disk."""
    if _DRIVER_LOG is None or _LOG_FAILED:
        return
    try:
        with _LOCK, _DRIVER_LOG.open("a", encoding="utf-8", errors="replace") as handle:
            for line in lines:
                handle.write(line.rstrip("\n") + "\n")
    except OSError as exc:
        _note_log_failure(exc)


class _DriverLogHandler(logging.FileHandler):
    """driver.log for Ray's and miles' loggers: a record it cannot write is dropped (`_note_log_failure`),
    never logging's own traceback on the terminal."""

    def emit(self, record: logging.LogRecord) -> None:
        if not _LOG_FAILED:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        error = sys.exc_info()[1]
        _note_log_failure(error if isinstance(error, OSError) else OSError(str(error)))


def _note_log_failure(exc: OSError) -> None:
    """Say once on stderr that driver.log cannot be written, and stop trying."""
    global _LOG_FAILED
    if not _LOG_FAILED:
        _LOG_FAILED = True
        why = exc.strerror or str(exc)
        print(
            f"miles: warning: cannot write {_DRIVER_LOG} ({why}); the rest of Ray's output is dropped",
            file=sys.stderr,
            flush=True,
        )


def write_driver_log(text: str) -> None:
    """Append `text` (a traceback, a note) to driver.log."""
    _append([f"{time.strftime('%H:%M:%S')} {line}" for line in text.splitlines()])


def _forwarded(data: dict[str, Any], ignore_prefix: bool = False) -> None:
    """Replaces Ray's printer of forwarded output (`ray._private.worker.print_to_stdstream`)."""
    source = data.get("actor_name") or data.get("task_name") or data.get("pid") or "ray"
    lines = [str(line) for line in data.get("lines") or []]
    _append([f"({source}) {line}" for line in lines])
    if data.get("pid") in ("raylet", "autoscaler"):
        return
    shown = [line for line in lines if line.startswith(USER_LINE)]
    if shown:
        print("\n".join(shown), file=sys.stdout, flush=True)


def quiet_ray(log_dir: Path) -> Path:
    """Send Ray's chatter to `log_dir/driver.log` (created); returns its path."""
    global _DRIVER_LOG, _LOG_FAILED
    try:
        import ray._private.worker as ray_worker  # first: importing Ray configures its logger
    except ImportError:  # a stand-in `ray` (tests)
        ray_worker = None

    log_dir.mkdir(parents=True, exist_ok=True)
    _DRIVER_LOG = log_dir / "driver.log"
    _LOG_FAILED = False
    handler = _DriverLogHandler(_DRIVER_LOG, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler._miles_driver_log = True  # type: ignore[attr-defined]
    # on the root logger: `ray.init(configure_logging=False)` clears the "ray" logger's own handlers, and its
    # records (the token-authentication notice among them) propagate here instead of to logging's last resort
    root = logging.getLogger()
    for old in list(root.handlers):
        if getattr(old, "_miles_driver_log", False):
            root.removeHandler(old)
    root.addHandler(handler)
    ray_logger = logging.getLogger("ray")  # Ray stops its propagation at import; the records must reach root
    ray_logger.setLevel(logging.INFO)
    ray_logger.propagate = True
    miles_logger = logging.getLogger("miles")  # miles' own warnings still reach the terminal, and the log
    miles_logger.setLevel(logging.INFO)  # info to driver.log only
    if not any(getattr(h, "_miles_terminal", False) for h in miles_logger.handlers):
        terminal = logging.StreamHandler(sys.stderr)
        terminal.setLevel(logging.WARNING)
        terminal.setFormatter(logging.Formatter("miles: warning: %(message)s"))
        terminal._miles_terminal = True  # type: ignore[attr-defined]
        miles_logger.addHandler(terminal)
    if ray_worker is not None and hasattr(ray_worker, "print_to_stdstream"):
        ray_worker.print_to_stdstream = _forwarded
    return _DRIVER_LOG
