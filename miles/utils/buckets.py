"""Cutting named sizes into buckets of at most a byte budget, in order (torch-free): the one rule behind
the weight-sync chunks of the in-process engines and the shards written for sglang engines."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def cut_by_bytes(sizes: Iterable[tuple[str, int]], limit: int | None) -> list[list[str]]:
    """The names of `(name, nbytes)` pairs in consecutive buckets of at most `limit` bytes each; an item larger
    than `limit` makes a bucket alone, and `limit=None` puts everything in one bucket. No empty buckets."""
    buckets: list[list[str]] = []
    size = 0
    for name, nbytes in sizes:
        if not buckets or (limit is not None and size + nbytes > limit):
            buckets.append([])
            size = 0
        buckets[-1].append(name)
        size += nbytes
    return buckets


def chunk_state_dict(state: dict[str, Any], buffer_bytes: int) -> list[dict[str, Any]]:
    """Split a state dict into chunks of at most `buffer_bytes` (a larger tensor travels alone)."""
    sizes = ((name, t.numel() * t.element_size()) for name, t in state.items())
    return [{name: state[name] for name in names} for names in cut_by_bytes(sizes, buffer_bytes)]
