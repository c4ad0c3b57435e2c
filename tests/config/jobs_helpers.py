"""Shared helpers of the config tests: a minimal valid job, resolved through `resolve()` (torch-free)."""

from __future__ import annotations

from typing import Any

import pytest

from miles.config.resolve import ResolvedJob, resolve
from miles.core.errors import ConfigError

# A minimal valid `train rl` job: 8 prompts x 4 samples = 32 samples per rollout, one GPU.
BASE: dict[str, Any] = {
    "hf_checkpoint": "tiny-sd3",
    "prompt_data": "p.jsonl",
    "rm_type": "digit",
    "rollout_batch_size": 8,
    "n_samples_per_prompt": 4,
    "diffusion_num_sde_steps": 2,
    "actor_num_gpus_per_node": 1,
    "num_gpus_per_node": 1,
}
EVAL_DATA = {"eval_prompt_data": ["digits=test.jsonl"]}
STRATEGY = "miles.sampling.step_strategies."
DROP = object()  # a value meaning "leave this flag off the command line"


def cli_for(job: str = "rl", **changes: Any) -> dict[str, Any]:
    cli = dict(BASE)
    if job == "eval":
        cli.update(EVAL_DATA)
    for dest, value in changes.items():
        if value is DROP:
            cli.pop(dest, None)
        else:
            cli[dest] = value
    return cli


def run(job: str = "rl", **changes: Any) -> ResolvedJob:
    return resolve(job, cli=cli_for(job, **changes), replay_path="rollout_0.pt" if job == "replay" else None)


def rejected(job: str = "rl", **changes: Any) -> str:
    with pytest.raises(ConfigError) as excinfo:
        run(job, **changes)
    message = str(excinfo.value)
    assert "\n" not in message, "a ConfigError is one line"
    return message


def assert_names(message: str, *parts: str) -> None:
    missing = [part for part in parts if part not in message]
    assert not missing, f"{missing} not in {message!r}"
