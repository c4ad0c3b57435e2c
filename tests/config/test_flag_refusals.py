"""Refusals (and the derivations next to them) of flags no other config test covers (torch-free).

One line each, naming the flag, its value and its source, as every ConfigError does.
"""

from __future__ import annotations

import os

import pytest
from jobs_helpers import BASE, assert_names, rejected, run

from miles.config.resolve import resolve
from miles.core.errors import ConfigError


@pytest.mark.parametrize(
    ("dest", "value", "only"),
    [("train_backend", "megatron", "fsdp"), ("optimizer", "sgd", "adam"), ("advantage_estimator", "ppo", "grpo")],
)
def test_single_value_enums_refuse_any_other_value(dest: str, value: str, only: str) -> None:
    """These flags take only the values miles implements (one each, two for the advantage estimator); another one is
    refused, not ignored."""
    assert getattr(run(**{dest: only}).args, dest) == only
    assert_names(rejected(**{dest: value}), f"--{dest.replace('_', '-')}", repr(value), only)


def test_train_env_vars_values_must_be_strings_or_numbers() -> None:
    assert run(train_env_vars={"NCCL_DEBUG": "INFO", "OMP_NUM_THREADS": 2}).args.train_env_vars["OMP_NUM_THREADS"] == 2
    assert_names(rejected(train_env_vars={"NCCL_DEBUG": ["INFO"]}), "--train-env-vars", "'NCCL_DEBUG'", "string")


def test_forward_dtype_must_equal_the_sglang_dit_precision() -> None:
    """The engine and the trainer run the DiT in one dtype: --sglang-dit-precision must agree."""
    args = resolve("rl", cli={**BASE, "diffusion_forward_dtype": "fp16"}, sglang={"dit_precision": "fp16"}).args
    assert args.diffusion_forward_dtype == "fp16"
    with pytest.raises(ConfigError) as excinfo:
        resolve("rl", cli={**BASE, "diffusion_forward_dtype": "bf16"}, sglang={"dit_precision": "fp16"})
    assert_names(str(excinfo.value), "--diffusion-forward-dtype bf16 (cli)", "--sglang-dit-precision fp16")


def test_recompute_old_log_prob_is_for_policy_loss_only() -> None:
    assert run(diffusion_recompute_old_log_prob=True).args.diffusion_recompute_old_log_prob is True
    message = rejected(diffusion_recompute_old_log_prob=True, loss_type="nft", use_ema=True)
    assert_names(message, "--diffusion-recompute-old-log-prob on (cli)", "--loss-type policy_loss only", "nft")


def test_grpo_guard_needs_the_flow_sde_kernel() -> None:
    """RatioNorm normalises the Flow-SDE Gaussian's log-ratio; CPS has no 1/(2 s^2) to normalise, and the guard is
    policy_loss's option."""
    assert run(diffusion_grpo_guard=True).args.diffusion_grpo_guard is True
    message = rejected(diffusion_grpo_guard=True, diffusion_sde_type="cps")
    assert_names(
        message, "--diffusion-grpo-guard on (cli)", "--diffusion-sde-type cps (cli)", "use --diffusion-sde-type sde"
    )
    message = rejected(diffusion_grpo_guard=True, loss_type="nft", use_ema=True)
    assert_names(message, "--diffusion-grpo-guard on (cli)", "--loss-type policy_loss only", "nft")


@pytest.mark.parametrize(
    ("job", "dest", "value", "why"),
    [
        ("sft", "save_debug_rollout_data", "r/{rollout_id}.pt", "`miles train sft` makes no rollouts to save"),
        ("rollout-only", "save_debug_train_data", "t/{rollout_id}.pt", "`miles rollout-only` saves no train data"),
        ("sft", "dump_details", "dumps", "`miles train sft` writes no debug dumps"),
        ("eval", "load_debug_rollout_data", "r.pt", "`miles eval` trains on no saved rollout"),
    ],
)
def test_debug_dumps_a_job_never_writes_are_refused(job: str, dest: str, value: str, why: str) -> None:
    assert_names(rejected(job, **{dest: value}), f"--{dest.replace('_', '-')} {value} (cli)", why)


def test_dump_details_fills_the_dump_paths_the_job_writes() -> None:
    here = os.getcwd()  # every path of a resolved job is absolute, against the working folder
    rl = run(dump_details="dumps/").args
    assert rl.save_debug_rollout_data == f"{here}/dumps/rollout_data/{{rollout_id}}.pt"
    assert rl.save_debug_train_data == f"{here}/dumps/train_data/{{rollout_id}}.pt"
    assert rl.source_of("save_debug_train_data") == "derived"
    # an explicit path wins; rollout-only writes no train data
    mine = run(dump_details="dumps", save_debug_rollout_data="mine/{rollout_id}.pt").args
    assert mine.save_debug_rollout_data == f"{here}/mine/{{rollout_id}}.pt"
    rollout_only = run("rollout-only", dump_details="dumps").args
    assert rollout_only.save_debug_rollout_data == f"{here}/dumps/rollout_data/{{rollout_id}}.pt"
    assert rollout_only.save_debug_train_data is None
    assert run().args.save_debug_rollout_data is None  # nothing is dumped unless asked


def test_subsample_needs_saved_rollouts() -> None:
    message = rejected(load_debug_rollout_data_subsample=0.5)
    assert_names(message, "--load-debug-rollout-data-subsample 0.5 (cli)", "requires --load-debug-rollout-data")
