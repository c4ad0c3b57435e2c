"""`--loss-type dpo`'s rules (torch-free): whole prompt groups in every optimizer window, a reference, its own flags
only under it, and the flags it would not read refused rather than ignored. One line each, naming flags and values."""

from __future__ import annotations

import pytest
from jobs_helpers import assert_names, rejected, run

from miles.config.resolve import resolve
from miles.core.errors import ConfigError

DPO = {"loss_type": "dpo", "global_batch_size": 8}  # BASE: 8 prompts x 4 samples, 4 steps of 2 whole groups


def test_a_valid_online_dpo_job_and_its_automatic_reference() -> None:
    args = run(**DPO).args
    assert (args.ref_mode, args.diffusion_dpo_beta, args.diffusion_dpo_num_timesteps) == ("frozen", 100.0, 1)
    assert args.num_steps_per_rollout == 4
    assert run(**DPO, use_lora=True).args.ref_mode == "lora_base"
    assert run(**DPO, use_ema=True, ref_mode="ema").args.ref_mode == "ema"
    flags = run(**DPO, diffusion_dpo_beta=5000.0, diffusion_dpo_num_timesteps=39).args
    assert (flags.diffusion_dpo_beta, flags.diffusion_dpo_num_timesteps) == (5000.0, 39)


def test_an_optimizer_window_must_hold_whole_groups() -> None:
    message = rejected(loss_type="dpo", global_batch_size=6, rollout_batch_size=3)
    assert_names(message, "--loss-type dpo", "--global-batch-size 6 (cli)", "--n-samples-per-prompt 4 (cli)", "split")


def test_groups_of_one_sample_make_no_pair() -> None:
    message = rejected(loss_type="dpo", n_samples_per_prompt=1)
    assert_names(message, "--loss-type dpo", "--n-samples-per-prompt 1 (cli)", "use 2 or more")
    message = rejected("replay", loss_type="dpo", n_samples_per_prompt=1)  # replay: the file's groups, named by n
    assert_names(message, "--n-samples-per-prompt 1 (cli)")


def test_dpo_needs_a_reference_and_a_positive_beta() -> None:
    assert_names(rejected(**DPO, ref_mode="none"), "--ref-mode none (cli)", "frozen", "lora_base")
    assert_names(rejected(**DPO, ref_mode="lora_base"), "--ref-mode lora_base (cli)", "requires --use-lora")
    assert_names(rejected(**DPO, diffusion_dpo_beta=0.0), "--diffusion-dpo-beta 0.0 (cli)", "must be > 0")
    assert_names(rejected(**DPO, diffusion_dpo_num_timesteps=0), "--diffusion-dpo-num-timesteps")


@pytest.mark.parametrize(
    ("dest", "value", "shown"),
    [
        ("globalize_reward_std", True, "--globalize-reward-std on (cli)"),
        ("globalize_reward_mean", True, "--globalize-reward-mean on (cli)"),
        ("disable_grpo_std_normalization", True, "--disable-grpo-std-normalization on (cli)"),
        ("custom_reward_post_process_path", "my.post", "--custom-reward-post-process-path my.post (cli)"),
        ("diffusion_kl_beta", 0.1, "--diffusion-kl-beta 0.1 (cli)"),
    ],
)
def test_flags_dpo_does_not_read_are_refused(dest: str, value: object, shown: str) -> None:
    assert_names(rejected(**DPO, **{dest: value}), shown, "not read by --loss-type dpo", "remove it")


def test_the_2d_tile_is_refused() -> None:
    message = rejected(**DPO, micro_batch_size_sample=2, micro_batch_size_tstep=2)
    assert_names(message, "--micro-batch-size-sample 2 (cli)", "--loss-type dpo", "use --micro-batch-size")


def test_dpo_flags_are_refused_under_another_method() -> None:
    for dest, value, shown in (
        ("diffusion_dpo_beta", 50.0, "--diffusion-dpo-beta 50.0 (cli)"),
        ("diffusion_dpo_num_timesteps", 2, "--diffusion-dpo-num-timesteps 2 (cli)"),
    ):
        assert_names(rejected(**{dest: value}), shown, "applies to --loss-type dpo only, not policy_loss")


def test_the_preference_keys_are_offline_only() -> None:
    """--chosen-key / --rejected-key name the columns of `train sft`'s preference rows: another job refuses them on
    the command line, and train sft under another method refuses them anywhere."""
    with pytest.raises(ConfigError, match=r"--chosen-key is for `miles train sft`, not `miles train rl`"):
        run(**DPO, chosen_key="good")
    with pytest.raises(ConfigError, match=r"--rejected-key is for `miles train sft`, not `miles train rl`"):
        run(**DPO, rejected_key="bad")
    with pytest.raises(ConfigError, match=r"--rejected-key bad \(cli\) applies to --loss-type dpo only, not sft_loss"):
        resolve("sft", recipe="tiny-digits-sft", cli={"rejected_key": "bad"})
    offline = resolve("sft", recipe="tiny-digits-dpo-offline", cli={"chosen_key": "good", "rejected_key": "bad"})
    assert (offline.args.chosen_key, offline.args.rejected_key) == ("good", "bad")
    assert offline.args.loss_type == "dpo" and offline.args.ref_mode == "frozen"


def test_offline_dpo_has_no_group_rule() -> None:
    """train sft pairs come from the rows: any --global-batch-size, no --n-samples-per-prompt needed."""
    args = resolve("sft", recipe="tiny-digits-dpo-offline", cli={"global_batch_size": 7}).args
    assert args.global_batch_size == 7 and args.n_samples_per_prompt == 1
