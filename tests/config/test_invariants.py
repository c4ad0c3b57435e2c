"""The batch-knob invariant, micro-batches and topology rules, through `resolve()` (fast, torch-free).

    rollout_batch_size x n_samples_per_prompt = global_batch_size x num_steps_per_rollout

Every rejection must be one ConfigError naming the flags involved and their values.
"""

from __future__ import annotations

from typing import Any

import pytest
from jobs_helpers import DROP, assert_names, rejected, run


def test_base_job_is_valid() -> None:
    resolved = run()
    assert resolved.spec.name == "rl"
    assert resolved.warnings == []


# ---- the batch-knob invariant: derivations --------------------------------------------------


def test_global_batch_size_derives_num_steps() -> None:
    args = run(global_batch_size=16).args
    assert args.num_steps_per_rollout == 2
    assert args.source_of("num_steps_per_rollout") == "derived"
    assert args.global_batch_size == 16
    assert args.source_of("global_batch_size") == "cli"


def test_num_steps_derives_global_batch_size() -> None:
    args = run(num_steps_per_rollout=4).args
    assert args.global_batch_size == 8
    assert args.source_of("global_batch_size") == "derived"
    assert args.source_of("num_steps_per_rollout") == "cli"


def test_neither_set_means_one_step_per_rollout() -> None:
    args = run().args
    assert args.num_steps_per_rollout == 1
    assert args.global_batch_size == 8 * 4
    assert args.source_of("num_steps_per_rollout") == "derived"
    assert args.source_of("global_batch_size") == "derived"


def test_both_set_and_consistent_are_accepted() -> None:
    args = run(global_batch_size=16, num_steps_per_rollout=2).args
    assert (args.global_batch_size, args.num_steps_per_rollout) == (16, 2)
    assert args.source_of("global_batch_size") == "cli"
    assert args.source_of("num_steps_per_rollout") == "cli"


@pytest.mark.parametrize(
    ("rbs", "n", "given", "expected"),
    [
        (8, 4, {"global_batch_size": 32}, (32, 1)),
        (8, 4, {"global_batch_size": 4}, (4, 8)),
        (8, 1, {}, (8, 1)),
        (3, 5, {"num_steps_per_rollout": 5}, (3, 5)),
        (6, 2, {"num_steps_per_rollout": 12}, (1, 12)),
        (2, 16, {"global_batch_size": 8, "num_steps_per_rollout": 4}, (8, 4)),
    ],
)
def test_invariant_holds_after_derivation(rbs: int, n: int, given: dict[str, int], expected: tuple[int, int]) -> None:
    args = run(rollout_batch_size=rbs, n_samples_per_prompt=n, **given).args
    assert (args.global_batch_size, args.num_steps_per_rollout) == expected
    assert args.rollout_batch_size * args.n_samples_per_prompt == args.global_batch_size * args.num_steps_per_rollout


def test_strings_from_the_command_line_are_parsed() -> None:
    args = run(rollout_batch_size="8", n_samples_per_prompt="4", global_batch_size="16").args
    assert (args.rollout_batch_size, args.global_batch_size, args.num_steps_per_rollout) == (8, 16, 2)


# ---- the batch-knob invariant: rejections ---------------------------------------------------


@pytest.mark.parametrize(("gbs", "steps"), [(7, 2), (16, 3), (64, 1)])
def test_contradicting_pair_is_rejected(gbs: int, steps: int) -> None:
    message = rejected(global_batch_size=gbs, num_steps_per_rollout=steps)
    assert_names(
        message,
        "batch-knob invariant",
        "--rollout-batch-size 8",
        "--n-samples-per-prompt 4",
        "= 32",
        f"--global-batch-size {gbs}",
        f"--num-steps-per-rollout {steps}",
        f"= {gbs * steps}",
    )


def test_global_batch_size_not_dividing_samples_is_rejected() -> None:
    message = rejected(global_batch_size=7)
    assert_names(
        message, "batch-knob invariant", "--global-batch-size 7", "--rollout-batch-size 8", "--n-samples-per-prompt 4"
    )
    assert "32" in message


def test_num_steps_not_dividing_samples_is_rejected() -> None:
    message = rejected(num_steps_per_rollout=3)
    assert_names(
        message,
        "batch-knob invariant",
        "--num-steps-per-rollout 3",
        "--rollout-batch-size 8",
        "--n-samples-per-prompt 4",
    )
    assert "32" in message


def test_global_batch_size_must_divide_by_dp_size() -> None:
    # 3 prompts x 4 samples = 12 = 6 x 2, but 6 samples do not split over 4 data-parallel ranks.
    message = rejected(rollout_batch_size=3, global_batch_size=6, actor_num_gpus_per_node=4, num_gpus_per_node=4)
    assert_names(message, "--global-batch-size 6", "dp_size 4", "--actor-num-gpus-per-node 4")


def test_derived_global_batch_size_must_divide_by_dp_size() -> None:
    message = rejected(rollout_batch_size=3, n_samples_per_prompt=1, actor_num_gpus_per_node=2, num_gpus_per_node=2)
    assert_names(message, "--global-batch-size 3 (derived)", "dp_size 2", "--actor-num-gpus-per-node 2")


def test_dp_size_accounts_for_sequence_parallel() -> None:
    # 4 GPUs / sp 2 = dp 2: a global batch of 2 divides.
    args = run(
        rollout_batch_size=1,
        n_samples_per_prompt=2,
        actor_num_gpus_per_node=4,
        num_gpus_per_node=4,
        sequence_parallel_size=2,
    ).args
    assert args.global_batch_size == 2


@pytest.mark.parametrize("job", ["rl", "rollout-only", "dmd2"])
def test_rollout_batch_size_is_required_where_the_job_generates(job: str) -> None:
    message = rejected(job, rollout_batch_size=DROP)
    assert "--rollout-batch-size" in message
    assert "required" in message


@pytest.mark.parametrize("job", ["replay", "eval"])
def test_rollout_batch_size_is_optional_for_replay_and_eval(job: str) -> None:
    args = run(job, rollout_batch_size=DROP).args
    assert args.rollout_batch_size is None


def test_sft_derives_rollout_batch_size_from_global_batch_size() -> None:
    args = run("sft", rollout_batch_size=DROP, n_samples_per_prompt=DROP, global_batch_size=16).args
    assert args.rollout_batch_size == 16
    assert args.source_of("rollout_batch_size") == "derived"
    assert args.num_steps_per_rollout == 1


def test_over_sampling_batch_size_must_equal_rollout_batch_size() -> None:
    message = rejected(over_sampling_batch_size=16)
    assert_names(message, "--over-sampling-batch-size 16", "--rollout-batch-size 8")
    assert run(over_sampling_batch_size=8).args.over_sampling_batch_size == 8


# ---- micro-batches -----------------------------------------------------------------------------


@pytest.mark.parametrize("given", ["micro_batch_size_sample", "micro_batch_size_tstep"])
def test_2d_micro_batch_pair_must_be_set_together(given: str) -> None:
    message = rejected(**{given: 2})
    assert_names(message, "--micro-batch-size-sample", "--micro-batch-size-tstep", "together")
    assert f"{given.replace('_', '-')} 2" in message


def test_2d_micro_batch_tile_derives_micro_batch_size() -> None:
    resolved = run(micro_batch_size_sample=2, micro_batch_size_tstep=3)
    assert resolved.args.micro_batch_size == 6
    assert resolved.args.source_of("micro_batch_size") == "derived"
    assert resolved.warnings == []


def test_2d_micro_batch_tile_replaces_an_explicit_micro_batch_size_with_a_warning() -> None:
    resolved = run(micro_batch_size_sample=2, micro_batch_size_tstep=3, micro_batch_size=4)
    assert resolved.args.micro_batch_size == 6
    assert len(resolved.warnings) == 1
    assert_names(resolved.warnings[0], "--micro-batch-size 4", "= 6")


# ---- topology: colocate and offload -------------------------------------------------------------


def test_colocate_forces_rollout_num_gpus_to_the_train_world_size() -> None:
    args = run(colocate=True, actor_num_gpus_per_node=2, num_gpus_per_node=2).args
    assert args.rollout_num_gpus == 2
    assert args.source_of("rollout_num_gpus") == "derived"


def test_colocate_accepts_a_matching_rollout_num_gpus() -> None:
    args = run(colocate=True, actor_num_gpus_per_node=2, num_gpus_per_node=2, rollout_num_gpus=2).args
    assert args.rollout_num_gpus == 2
    assert args.source_of("rollout_num_gpus") == "cli"


def test_colocate_rejects_a_contradicting_rollout_num_gpus() -> None:
    message = rejected(colocate=True, actor_num_gpus_per_node=2, num_gpus_per_node=2, rollout_num_gpus=4)
    assert_names(message, "--rollout-num-gpus 4", "--colocate on", "world size 2")


@pytest.mark.parametrize("switch", ["colocate", "offload"])
def test_colocate_and_offload_turn_on_both_offload_tristates(switch: str) -> None:
    args = run(**{switch: True}).args
    for dest in ("offload_train", "offload_rollout"):
        assert getattr(args, dest) is True
        assert args.source_of(dest) == "derived"


def test_offload_tristates_stay_unset_by_default() -> None:
    args = run().args
    assert args.offload_train is None
    assert args.offload_rollout is None
    assert args.source_of("offload_train") == "default"


@pytest.mark.parametrize("switch", ["colocate", "offload"])
@pytest.mark.parametrize("dest", ["offload_train", "offload_rollout"])
def test_explicit_no_offload_contradicts_colocate_and_offload(switch: str, dest: str) -> None:
    message = rejected(**{switch: True, dest: False})
    assert_names(message, f"--{dest.replace('_', '-')} off", f"--{switch} on")


def test_explicit_offload_on_agrees_with_colocate() -> None:
    args = run(colocate=True, offload_train=True).args
    assert args.offload_train is True
    assert args.source_of("offload_train") == "cli"
    assert args.source_of("offload_rollout") == "derived"


@pytest.mark.parametrize(
    ("extra", "missing"),
    [
        ({}, ("--use-lora", "--colocate")),
        ({"use_lora": True}, ("--colocate",)),
        ({"colocate": True}, ("--use-lora",)),
    ],
)
def test_lora_ipc_weight_sync_needs_lora_and_colocate(extra: dict[str, Any], missing: tuple[str, ...]) -> None:
    message = rejected(lora_ipc_weight_sync=True, **extra)
    assert_names(message, "--lora-ipc-weight-sync on", *missing)
    for present in {"--use-lora", "--colocate"} - set(missing):
        assert f"requires {present}" not in message


def test_lora_ipc_weight_sync_with_lora_and_colocate() -> None:
    assert run(lora_ipc_weight_sync=True, use_lora=True, colocate=True).args.lora_ipc_weight_sync is True


def test_colocate_reward_requires_colocate() -> None:
    message = rejected(colocate_reward=True)
    assert_names(message, "--colocate-reward on", "--colocate")
    assert run(colocate_reward=True, colocate=True).args.colocate_reward is True
