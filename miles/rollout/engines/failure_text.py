"""The text of an error an engine actor raised, as one line (torch-free, Ray-free).

Ray hands an error raised in an actor method back with the original as `.cause`; an error raised in the actor's
constructor (an engine whose server did not start) only as text: "The actor died because of an error raised in its
creation task, ray::...(pid=..., ip=...)", the traceback, then "ModuleError: message" and the message's other lines.
`raised_text` finds the message in both, so that a start failure keeps its cause (the exception text and the
server's last log lines) instead of Ray's header.
"""

from __future__ import annotations

import re

_RAISED = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Failure|Timeout|Interrupt|Exit)): ", re.MULTILINE)
_MAX_CHARS = 600


def innermost(exc: BaseException) -> BaseException:
    cause = exc
    seen: set[int] = set()
    while isinstance(getattr(cause, "cause", None), BaseException) and id(cause) not in seen:
        seen.add(id(cause))
        cause = cause.cause  # type: ignore[attr-defined]
    return cause


def constructor_failed(exc: BaseException) -> bool:
    """Whether `exc` says the actor's constructor raised (Ray's "creation task" text), not that its process died."""
    return "creation task" in str(innermost(exc))


def raised_text(exc: BaseException) -> str:
    """The message (all its lines) of the innermost error under `exc`; for an actor whose constructor raised, the
    message Ray kept in its text."""
    cause = innermost(exc)
    text = str(cause).strip()
    if constructor_failed(cause):
        last = text  # a chained error: the one raised last follows the last "... occurred:" / "... exception:"
        for marker in ("another exception occurred:", "the direct cause of the following exception:"):
            if marker in last:
                last = last[last.rindex(marker) + len(marker) :]
        found = _RAISED.search(last)  # the first unindented "Error: " line after the (indented) traceback
        if found:
            return last[found.end() :].strip()
    return text or type(cause).__name__


def _lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip()]


def first_line(exc: BaseException) -> str:
    """The first line of `raised_text(exc)`, without its final period."""
    lines = _lines(raised_text(exc))
    return lines[0].rstrip(".") if lines else type(innermost(exc)).__name__


def with_cause(exc: BaseException) -> str:
    """`raised_text(exc)` in one line: its first line, plus its first error line after that (a start failure's
    message ends with the server's log tail, errors first), else the last line of that tail."""
    lines = _lines(raised_text(exc))
    if not lines:
        return type(innermost(exc)).__name__
    head, rest = lines[0], lines[1:]
    errors = [line for line in rest if "ERROR" in line or "Error" in line]
    if errors:
        line = f"{head} {errors[0]}"
    elif rest:
        line = f"{head} last log line: {rest[-1]}"
    else:
        line = head
    return line if len(line) <= _MAX_CHARS else line[: _MAX_CHARS - 3] + "..."
