"""Short text for messages (torch-free): user data is quoted clipped, never in bulk."""

from __future__ import annotations

CLIP = 80  # characters of a user value a message may quote


def clip(text: str, limit: int = CLIP) -> str:
    """`text` when it fits in `limit` characters, else its head, '...' and how long it was."""
    if len(text) <= limit:
        return text
    head = max(1, limit - 3)
    return f"{text[:head]}... ({len(text):,} chars)"


def clip_repr(value: object, limit: int = CLIP) -> str:
    """`repr(value)` in about `limit` characters; a huge value is never rendered whole."""
    if isinstance(value, str) and len(value) > limit:
        return f"{value[:limit]!r}... ({len(value):,} chars)"
    if isinstance(value, (list, dict, tuple)) and len(value) > limit:
        return f"a {type(value).__name__} of {len(value):,} items"
    return clip(repr(value), limit)
