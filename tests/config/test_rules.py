"""Model, reward, eval, checkpoint and algorithm rules, and the per-job auto values, through `resolve()`.

Every rejection must be one ConfigError naming the flags involved and their values.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from jobs_helpers import DROP, EVAL_DATA, STRATEGY, assert_names, cli_for, rejected, run

from miles.config.resolve import resolve

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


def test_true_cfg_scale_is_refused_for_a_plain_cfg_family() -> None:
    message = rejected(diffusion_true_cfg_scale=4.0)  # the default checkpoint is tiny-sd3
    assert_names(message, "--diffusion-true-cfg-scale 4.0", "'sd3'", "plain CFG")
    for checkpoint in ("tiny-flux", "tiny-qwen-image"):
        assert run(hf_checkpoint=checkpoint, diffusion_true_cfg_scale=4.0).args.diffusion_true_cfg_scale == 4.0


def test_a_reward_that_reads_the_source_needs_a_family_that_edits() -> None:
    """clip_i scores an edit against its source: on a text-to-image family no sample has one (refused before Ray);
    on the edit family it resolves."""
    message = rejected(rm_type="clip_i", clip_score_model_path="/m", clip_score_processor_path="/p")
    assert_names(message, "--rm-type clip_i", "scores an edit against its source image", "'sd3' takes none")
    message = rejected(reward_weights={"digit": 1.0, "digit_edit": 0.5})
    assert_names(message, "--reward-weights", "digit_edit scores an edit", "'sd3'")
    edit = run(
        hf_checkpoint="tiny-flux-kontext",
        prompt_data="digits-edit:train",
        eval_prompt_data=None,
        rm_type="digit_edit",
    )
    assert edit.args.diffusion_model_family == "flux_kontext"


def test_flux_true_cfg_on_sglang_is_refused_when_the_text_length_is_not_sglangs(tmp_path) -> None:
    """sglang encodes FLUX's negative prompt at 512 T5 tokens whatever the request says: with a negative branch and
    a checkpoint of another text length (every tiny build), its guided velocity is not FluxPipeline's."""
    import sys

    sglang = {"rollout_backend": "sglang", "sglang_python": sys.executable, "distributed_backend": "gloo"}
    message = rejected(hf_checkpoint="tiny-flux", diffusion_true_cfg_scale=4.0, **sglang)
    assert_names(message, "--rollout-backend sglang", "--diffusion-true-cfg-scale 4.0", "512", "length is 8")
    # embedded guidance alone (no negative branch) is served, as is true CFG at sglang's own 512 tokens
    assert run(hf_checkpoint="tiny-flux", **sglang).args.rollout_backend == "sglang"
    flux_dev = tmp_path / "FLUX.1-dev"  # no tiny metadata: FLUX.1's 512 tokens
    flux_dev.mkdir()
    assert (
        run(hf_checkpoint=str(flux_dev), diffusion_true_cfg_scale=4.0, **sglang).args.diffusion_true_cfg_scale == 4.0
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
    assert args.rm_type == ["pickscore"]


def test_eval_interval_requires_eval_data() -> None:
    message = rejected(eval_interval=5)
    assert_names(message, "--eval-interval 5", "--eval-prompt-data")
    args = run(eval_interval=5, **EVAL_DATA).args
    assert args.eval_prompt_data == {"digits": os.path.abspath("test.jsonl")}


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
        # nft picks the EMA reference (pi_old) even when a KL is asked for; the KL's is the LoRA base.
        ({"loss_type": "nft", "use_ema": True, "diffusion_kl_beta": 0.04, "use_lora": True}, "ema"),
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


# ---- the LR schedule -------------------------------------------------------------------------------------


def test_override_lr_scheduler_alone_turns_the_checkpoints_schedule_off() -> None:
    resolved = run(override_lr_scheduler=True)
    assert resolved.args.override_lr_scheduler and not resolved.args.use_checkpoint_lr_scheduler
    assert resolved.args.source_of("use_checkpoint_lr_scheduler") == "derived"
    assert run().args.use_checkpoint_lr_scheduler  # the default stays on
    message = rejected(override_lr_scheduler=True, use_checkpoint_lr_scheduler=True)
    assert_names(message, "--override-lr-scheduler on (cli)", "--use-checkpoint-lr-scheduler on (cli)", "pick one")


def test_warmup_fraction_and_iters_exclude_each_other() -> None:
    message = rejected(lr_warmup_fraction=0.1, lr_warmup_iters=5)
    assert_names(message, "--lr-warmup-fraction 0.1", "--lr-warmup-iters 5", "use one")
    assert run(lr_warmup_fraction=0.1).args.lr_warmup_fraction == 0.1


def test_wsd_needs_its_decay_length() -> None:
    assert_names(rejected(lr_decay_style="WSD"), "--lr-decay-style WSD", "--lr-wsd-decay-iters")
    assert run(lr_decay_style="WSD", lr_wsd_decay_iters=4).args.lr_wsd_decay_iters == 4


def test_nft_kl_needs_the_lora_base() -> None:
    nft = {"loss_type": "nft", "use_ema": True, "diffusion_kl_beta": 0.01}
    assert_names(rejected(**nft), "--diffusion-kl-beta 0.01", "LoRA base", "--use-lora")
    assert run(**nft, use_lora=True).args.diffusion_kl_beta == 0.01


# ---- the CI metric check -------------------------------------------------------------------------------------

CI = {"ci_test": True, "ci_metric_checker_key": "eval/digits/accuracy", "ci_metric_checker_threshold": 0.5}


@pytest.mark.parametrize("job", ["rl", "sft", "eval"])
def test_ci_test_takes_a_key_and_a_threshold(job: str) -> None:
    args = run(job, **CI).args
    assert (args.ci_test, args.ci_metric_checker_key, args.ci_metric_checker_threshold) == (
        True,
        "eval/digits/accuracy",
        0.5,
    )
    assert_names(
        rejected(job, ci_test=True),
        "--ci-test on (cli)",
        "requires --ci-metric-checker-key and --ci-metric-checker-threshold",
    )
    message = rejected(job, ci_test=True, ci_metric_checker_key="train/loss")
    assert_names(message, "--ci-test on (cli)", "requires --ci-metric-checker-threshold")
    assert "--ci-metric-checker-key and" not in message


def test_ci_checker_flags_need_ci_test() -> None:
    assert_names(rejected(ci_metric_checker_key="train/loss"), "--ci-metric-checker-key train/loss (cli)", "--ci-test")
    message = rejected(ci_metric_checker_key="train/loss", ci_metric_checker_threshold=1.0)
    assert_names(message, "--ci-metric-checker-key train/loss", "--ci-metric-checker-threshold 1.0", "--ci-test")


def test_ci_test_is_refused_where_no_check_runs() -> None:
    assert_names(rejected("rollout-only", **CI), "--ci-test on (cli)", "`miles rollout-only` runs no CI metric check")


def test_sft_eval_runs_on_the_diffusers_backend() -> None:
    sft_eval = {**EVAL_DATA, "eval_interval": 2}
    assert run("sft", **sft_eval).args.eval_interval == 2
    message = rejected("sft", **sft_eval, rollout_backend="sglang")
    assert_names(message, "--rollout-backend sglang (cli)", "in-process diffusers engine")
