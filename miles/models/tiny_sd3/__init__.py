"""The embedded default model: SD3's architecture at toy size, built offline from a seed.

Torch-free at import; `build_tiny_sd3` (which imports torch/diffusers) is loaded on first access.
"""

from __future__ import annotations

from typing import Any

from miles.models.tiny_sd3.metadata import (
    METADATA_FILE,
    TINY_SD3_NAME,
    default_resolution,
    is_tiny_sd3,
    max_sequence_length,
    read_metadata,
)

__all__ = [
    "METADATA_FILE",
    "TINY_SD3_NAME",
    "BuildReport",
    "build_tiny_sd3",
    "default_resolution",
    "is_tiny_sd3",
    "max_sequence_length",
    "read_metadata",
]


def __getattr__(name: str) -> Any:
    if name in ("build_tiny_sd3", "BuildReport"):
        from miles.models.tiny_sd3 import builder

        return getattr(builder, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
