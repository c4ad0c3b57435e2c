"""Errors raised while resolving a job's arguments (torch-free)."""

from __future__ import annotations


class ConfigError(Exception):
    """A user mistake in flags, a recipe or a YAML file.

    The CLI prints it as one line and exits with code 2 (a usage error), with no traceback.
    The message names the flag, file, line or key and the offending values.
    """


class RuntimeUnavailable(Exception):
    """The job's runtime is not built yet (exit code 3)."""


class EngineFailure(RuntimeError):
    """A rollout engine died or misbehaved and the run cannot go on (exit code 1, one line, no traceback).

    The message names the engine (index, URL, pid, log file)."""


def find_engine_failure(exc: BaseException) -> str | None:
    """The message of an `EngineFailure` raised anywhere under `exc`. Ray wraps an error raised in an
    actor (the wrapper is an instance of the error's class too, with the original as `.cause` and a
    traceback in its text); an actor whose constructor raised only keeps the text."""
    seen: set[int] = set()
    current: BaseException | None = exc
    innermost: EngineFailure | None = None
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, EngineFailure):
            innermost = current
        current = getattr(current, "cause", None) or current.__cause__
    if innermost is not None:
        text = str(innermost).strip()
        return text.splitlines()[-1] if getattr(innermost, "cause", None) is not None else text
    marker = "RolloutEngineError: "
    text = str(exc)
    if marker in text:
        return text[text.rindex(marker) + len(marker) :].strip().splitlines()[0]
    return None
