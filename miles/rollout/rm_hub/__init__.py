"""Built-in reward models and their dispatch. The reward types are the table `miles.rewards.REWARD_TYPES`: `digit`
(a digit classifier's p(label) for the embedded tiny-sd3 task), `ocr` (RapidOCR, PP-OCRv4 ONNX, offline),
`pickscore`, `clip_score`, `aesthetic`, `hpsv2`, `image_reward` (local weights), `vlm_judge` (an OpenAI chat server),
`jpeg_compressibility` / `jpeg_incompressibility`, and `remote_rm` (a `miles reward serve` service, `service/`).
The entry point is `batched_async_rm(args, samples)` (`dispatch.py`); Ray actor pools for the model-backed rewards
are in `pool.py` (`make_reward_pools`).

Lightweight at import (no torch, Ray or model imports): the names below load their module on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "batched_async_rm": "miles.rollout.rm_hub.dispatch",
    "score_samples": "miles.rollout.rm_hub.dispatch",
    "score_groups": "miles.rollout.rm_hub.dispatch",
    "set_reward_pools": "miles.rollout.rm_hub.dispatch",
    "get_reward_pools": "miles.rollout.rm_hub.dispatch",
    "RewardError": "miles.rollout.rm_hub.dispatch",
    "BUILTIN_RM_TYPES": "miles.rollout.rm_hub.dispatch",
    "RewardPool": "miles.rollout.rm_hub.pool",
    "make_reward_pools": "miles.rollout.rm_hub.pool",
    "shutdown_reward_pools": "miles.rollout.rm_hub.pool",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
