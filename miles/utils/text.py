"""Short text for messages (torch-free): user data is quoted clipped, never in bulk."""

from __future__ import annotations

CLIP = 80  # characters of a user value a message may quote


def clip(text: str, limit: int = CLIP) -> str:
    """`text` when it fits in `limit` characters, else its head, '...' and how long it was."""
    if len(text) <= limit:
        return text
    head = max(1, limit - 3)
    return f"{text[:head]}... ({len(text):,} chars)"


def first_line(text: object, limit: int = 200) -> str:
    """The first line of `text` (an exception's message, say), clipped to `limit` characters."""
    return clip((str(text).strip().splitlines() or [""])[0], limit)


def clip_repr(value: object, limit: int = CLIP) -> str:
    """`repr(value)` in about `limit` characters; a huge value is never rendered whole."""
    if isinstance(value, str) and len(value) > limit:
        return f"{value[:limit]!r}... ({len(value):,} chars)"
    if isinstance(value, (list, dict, tuple)) and len(value) > limit:
        return f"a {type(value).__name__} of {len(value):,} items"
    return clip(repr(value), limit)


LINE = 600  # characters a line of an error message may take (a long path fits; a pasted value does not)
LINES = 40  # lines an error message may take (a preflight lists one problem a line)


def bounded(message: str, line_limit: int = LINE, max_lines: int = LINES) -> str:
    """An error message as the terminal gets it: each line clipped to `line_limit` characters and at most
    `max_lines` lines, so user data that reached a message (a value, a parser's excerpt, an exception's text)
    is never echoed in bulk."""
    lines = str(message).splitlines() or [""]
    shown = [clip(line, line_limit) for line in lines[:max_lines]]
    if len(lines) > max_lines:
        shown.append(f"  ... and {len(lines) - max_lines:,} more lines")
    return "\n".join(shown)
