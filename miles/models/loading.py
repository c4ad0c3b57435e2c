"""Loading diffusers/transformers components quietly (no per-component progress bars or info logs), and
the torch dtypes the `--*-dtype` flags name."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

DTYPE_NAMES = ("fp32", "bf16", "fp16")


def torch_dtype(name: str) -> Any:
    """`fp32` / `bf16` / `fp16` -> the torch dtype."""
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


@contextlib.contextmanager
def quiet_loading() -> Iterator[None]:
    """No per-component progress bars or info logs while a pipeline loads."""
    from diffusers.utils import logging as dlog
    from transformers.utils import logging as tlog

    levels = (dlog.get_verbosity(), tlog.get_verbosity())
    dlog.set_verbosity_error()
    tlog.set_verbosity_error()
    dlog.disable_progress_bar()
    tlog.disable_progress_bar()
    try:
        yield
    finally:
        dlog.set_verbosity(levels[0])
        tlog.set_verbosity(levels[1])
        dlog.enable_progress_bar()
        tlog.enable_progress_bar()
