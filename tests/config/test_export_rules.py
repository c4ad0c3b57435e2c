"""The periodic-export flags' rules: `--export-merged` needs `--export-interval` and `--use-lora`, and both flags
belong to the training jobs (refused for the others)."""

from __future__ import annotations

import pytest

from miles.config.resolve import resolve
from miles.core.errors import ConfigError

JOB = {
    "hf_checkpoint": "tiny-sd3",
    "prompt_data": "digits:labels",
    "rm_type": "digit",
    "rollout_batch_size": 2,
    "n_samples_per_prompt": 2,
    "diffusion_num_sde_steps": 2,
    "actor_num_gpus_per_node": 1,
    "num_gpus_per_node": 1,
}


@pytest.mark.parametrize(
    ("job", "cli", "message"),
    [
        ("rl", {"export_merged": True, "use_lora": True}, "--export-merged .* needs --export-interval N"),
        ("rl", {"export_merged": True, "export_interval": 2}, "without --use-lora every export is the merged"),
        ("eval", {"export_interval": 2}, "--export-interval"),
    ],
)
def test_export_flags_are_refused_where_they_mean_nothing(job: str, cli: dict, message: str) -> None:
    base = JOB if job == "rl" else {"hf_checkpoint": "tiny-sd3", "eval_prompt_data": ["digits=digits:test"]}
    with pytest.raises(ConfigError, match=message):
        resolve(job, cli={**base, **cli})


def test_export_interval_resolves_for_train_rl() -> None:
    args = resolve("rl", cli={**JOB, "export_interval": 5, "export_merged": True, "use_lora": True}).args
    assert args.export_interval == 5 and args.export_merged


def test_export_interval_resolves_for_train_dmd2() -> None:
    cli = {"hf_checkpoint": "tiny-sd3", "teacher_checkpoint": "tiny-sd3", "export_interval": 2}
    assert resolve("dmd2", cli=cli, recipe="tiny-digits-4step").args.export_interval == 2
