"""Shared by the trainer tests: the small tiny-digits-grpo job they train on, and a free gloo port."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

from miles.config.resolve import resolve

SMALL: dict[str, Any] = {
    "rollout_batch_size": 2,
    "n_samples_per_prompt": 4,
    "rollout_microgroup_size": 4,
    "global_batch_size": 8,
    "micro_batch_size": 4,
    "diffusion_num_steps": 4,
    "diffusion_num_sde_steps": 2,
    "diffusion_sde_window_range": "0,4",
    "lr_warmup_iters": 0,  # the recipe warms up over 20 steps; these tests take one or two at full lr
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trainer_args(checkpoint: Path, **cli: Any) -> Any:
    """`train rl --recipe tiny-digits-grpo` on `checkpoint`, cut to SMALL, with `cli` on top."""
    return resolve("rl", recipe="tiny-digits-grpo", cli={**SMALL, "hf_checkpoint": str(checkpoint), **cli}).args
