"""The batch-knob invariant and the other parse-time rules, through `resolve()` (fast, torch-free).

    rollout_batch_size x n_samples_per_prompt = global_batch_size x num_steps_per_rollout

Every rejection must be one ConfigError naming the flags involved and their values.
"""

from __future__ import annotations

from typing import Any

import pytest

from miles.config.errors import ConfigError
from miles.config.resolve import ResolvedJob, resolve

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
STRATEGY = "miles.rollout.step_strategy_hub."
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


# ---- model, reward, eval, checkpoints ----------------------------------------------------------------


def test_save_interval_requires_save() -> None:
    message = rejected(save_interval=10)
    assert_names(message, "--save-interval 10", "--save ")
    assert run(save_interval=10, save="/tmp/ckpt").args.save_interval == 10


def test_model_family_and_pipeline_config_path_exclude_each_other() -> None:
    message = rejected(diffusion_model_family="sd3", train_pipeline_config_path="my_pkg.configs.MyConfig")
    assert_names(
        message, "--diffusion-model-family sd3", "--train-pipeline-config-path my_pkg.configs.MyConfig", "exclusive"
    )


@pytest.mark.parametrize(
    ("given", "missing"),
    [
        ({}, ("--pickscore-model-path", "--pickscore-processor-path")),
        ({"pickscore_model_path": "m"}, ("--pickscore-processor-path",)),
        ({"pickscore_processor_path": "p"}, ("--pickscore-model-path",)),
    ],
)
def test_pickscore_requires_its_paths(given: dict[str, str], missing: tuple[str, ...]) -> None:
    message = rejected(rm_type="pickscore", **given)
    assert_names(message, "--rm-type pickscore", *missing)


def test_pickscore_with_both_paths() -> None:
    args = run(rm_type="pickscore", pickscore_model_path="m", pickscore_processor_path="p").args
    assert args.rm_type == "pickscore"


def test_eval_interval_requires_eval_data() -> None:
    message = rejected(eval_interval=5)
    assert_names(message, "--eval-interval 5", "--eval-prompt-data")
    args = run(eval_interval=5, **EVAL_DATA).args
    assert args.eval_prompt_data == {"digits": "test.jsonl"}


def test_eval_job_needs_eval_data() -> None:
    message = rejected("eval", eval_prompt_data=DROP)
    assert_names(message, "`miles eval`", "--eval-prompt-data")


def test_num_epoch_with_num_rollout_is_a_warning() -> None:
    resolved = run(num_epoch=2, num_rollout=3)
    assert resolved.args.num_epoch == 2
    assert resolved.args.num_rollout == 3
    assert len(resolved.warnings) == 1
    assert_names(resolved.warnings[0], "--num-epoch 2", "--num-rollout 3", "ignored")


# ---- algorithm: reference model, loss type per job --------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({}, "none"),
        ({"diffusion_kl_beta": 0.04, "use_lora": True}, "lora_base"),
        ({"loss_type": "nft", "use_ema": True}, "ema"),
        # nft picks the EMA reference even when a KL is asked for.
        ({"loss_type": "nft", "use_ema": True, "diffusion_kl_beta": 0.04}, "ema"),
    ],
)
def test_ref_mode_auto(extra: dict[str, Any], expected: str) -> None:
    args = run(**extra).args
    assert args.ref_mode == expected
    assert args.source_of("ref_mode") == "derived"


def test_explicit_ref_mode_is_kept() -> None:
    args = run(ref_mode="lora_base", use_lora=True).args
    assert args.ref_mode == "lora_base"
    assert args.source_of("ref_mode") == "cli"


def test_kl_without_lora_cannot_use_the_auto_lora_base_reference() -> None:
    message = rejected(diffusion_kl_beta=0.04)
    assert_names(message, "--ref-mode lora_base (derived)", "--use-lora")


def test_kl_with_no_reference_is_rejected() -> None:
    message = rejected(diffusion_kl_beta=0.04, ref_mode="none")
    assert_names(message, "--diffusion-kl-beta 0.04", "--ref-mode none")


def test_nft_without_ema_cannot_use_the_auto_ema_reference() -> None:
    message = rejected(loss_type="nft")
    assert_names(message, "--ref-mode ema (derived)", "--use-ema")


@pytest.mark.parametrize(
    ("job", "loss"),
    [("rl", "policy_loss"), ("sft", "sft_loss"), ("dmd2", "dmd2"), ("replay", "policy_loss")],
)
def test_auto_loss_type_per_training_job(job: str, loss: str) -> None:
    args = run(job).args
    assert args.loss_type == loss
    assert args.source_of("loss_type") == "derived"


@pytest.mark.parametrize("job", ["eval", "rollout-only"])
def test_no_loss_type_for_jobs_that_do_not_train(job: str) -> None:
    args = run(job).args
    assert args.loss_type is None
    assert args.source_of("loss_type") == "default"


@pytest.mark.parametrize(
    ("job", "loss", "command"),
    [
        ("sft", "nft", "train sft"),
        ("sft", "policy_loss", "train sft"),
        ("rl", "sft_loss", "train rl"),
        ("rl", "dmd2", "train rl"),
        ("dmd2", "policy_loss", "train dmd2"),
    ],
)
def test_loss_type_foreign_to_the_job_is_rejected(job: str, loss: str, command: str) -> None:
    message = rejected(job, loss_type=loss)
    assert_names(message, f"--loss-type {loss}", f"`miles {command}`")


def test_loss_type_on_the_command_line_of_eval_is_rejected() -> None:
    message = rejected("eval", loss_type="nft")
    assert_names(message, "--loss-type nft", "`miles eval`")


def test_sft_forces_train_only() -> None:
    args = run("sft").args
    assert args.train_only is True
    assert args.source_of("train_only") == "derived"
    explicit = run("sft", train_only=True).args
    assert explicit.train_only is True
    assert explicit.source_of("train_only") == "cli"


def test_sft_rejects_no_train_only() -> None:
    message = rejected("sft", train_only=False)
    assert_names(message, "--train-only off", "`miles train sft`")


def test_rollout_only_forces_debug_rollout_only() -> None:
    args = run("rollout-only").args
    assert args.debug_rollout_only is True
    assert args.source_of("debug_rollout_only") == "derived"


@pytest.mark.parametrize(
    ("job", "dest", "value", "owner", "command"),
    [
        ("rl", "dmd2_critic_update_ratio", 3, "`miles train dmd2`", "`miles train rl`"),
        ("rl", "teacher_checkpoint", "teacher", "`miles train dmd2`", "`miles train rl`"),
        ("sft", "dmd2_student_timesteps", "999,499", "`miles train dmd2`", "`miles train sft`"),
        ("sft", "diffusion_nft_beta", 0.5, "`miles train rl`", "`miles train sft`"),
        ("rl", "sft_encoder_checkpoint", "enc", "`miles train sft`", "`miles train rl`"),
    ],
)
def test_flag_of_another_job_is_rejected_naming_both_jobs(
    job: str, dest: str, value: Any, owner: str, command: str
) -> None:
    message = rejected(job, **{dest: value})
    assert_names(message, f"--{dest.replace('_', '-')}", owner, command)


def test_dmd2_flags_are_accepted_under_dmd2() -> None:
    args = run("dmd2", dmd2_critic_update_ratio=3).args
    assert args.dmd2_critic_update_ratio == 3
    # dmd2's own auto values.
    assert args.teacher_checkpoint == "tiny-sd3"
    assert args.source_of("teacher_checkpoint") == "derived"
    assert args.dmd2_real_guidance_scale == args.diffusion_guidance_scale


# ---- sampler: SDE type, window, candidate steps ----------------------------------------------------------------


def test_policy_loss_with_ode_is_rejected() -> None:
    message = rejected(diffusion_sde_type="ode")
    assert_names(message, "--loss-type policy_loss", "--diffusion-sde-type ode")


def test_nft_with_ode_is_accepted() -> None:
    args = run(diffusion_sde_type="ode", loss_type="nft", use_ema=True).args
    assert (args.loss_type, args.diffusion_sde_type) == ("nft", "ode")


def test_policy_loss_needs_trained_sde_steps() -> None:
    message = rejected(diffusion_num_sde_steps=DROP)
    assert_names(message, "--loss-type policy_loss", "--diffusion-num-sde-steps", "--diffusion-step-strategy-path")


def test_num_sde_steps_cannot_exceed_num_steps() -> None:
    message = rejected(diffusion_num_sde_steps=11)
    assert_names(message, "--diffusion-num-sde-steps 11", "--diffusion-num-steps 10")


@pytest.mark.parametrize("window", ["0,11", "2,12"])
def test_sde_window_must_lie_within_the_schedule(window: str) -> None:
    message = rejected(diffusion_sde_window_range=window)
    assert_names(message, f"--diffusion-sde-window-range {window}", "--diffusion-num-steps", "10")


def test_sde_window_inside_the_schedule_is_parsed() -> None:
    args = run(diffusion_sde_window_range="0,6", diffusion_step_strategy_path=STRATEGY + "sde_window").args
    assert args.diffusion_sde_window_range == [0, 6]


def test_sde_window_strategy_needs_room_for_the_sde_steps() -> None:
    message = rejected(diffusion_step_strategy_path=STRATEGY + "sde_window", diffusion_sde_window_range="0,1")
    assert_names(message, "--diffusion-num-sde-steps 2", "[0, 1)", "--diffusion-sde-window-range")


def test_candidate_steps_must_lie_within_the_schedule() -> None:
    message = rejected(diffusion_sde_candidate_steps="1,10")
    assert_names(message, "--diffusion-sde-candidate-steps 1,10", "[10]", "--diffusion-num-steps 10")


def test_epoch_global_random_choice_requires_candidate_steps() -> None:
    strategy = STRATEGY + "epoch_global_random_choice"
    message = rejected(diffusion_step_strategy_path=strategy)
    assert_names(message, f"--diffusion-step-strategy-path {strategy}", "--diffusion-sde-candidate-steps")
    args = run(diffusion_step_strategy_path=strategy, diffusion_sde_candidate_steps="1,2,3").args
    assert args.diffusion_sde_candidate_steps == [1, 2, 3]


# ---- values come with the source that set them -------------------------------------------------------------


def test_overrides_and_sglang_reach_resolve() -> None:
    resolved = resolve("dmd2", cli=cli_for("dmd2"), overrides=["critic.lr=2e-6"], sglang={"attention_backend": "fa3"})
    assert resolved.trainer_args["critic"].lr == 2e-6
    assert resolved.trainer_args["actor"].lr == resolved.args.lr
    assert resolved.args.sglang_args == {"attention_backend": "fa3"}
