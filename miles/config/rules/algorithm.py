"""Algorithm, reference model, EMA, sampler and DMD2 rules."""

from __future__ import annotations

from itertools import pairwise
from typing import TYPE_CHECKING

from miles.config.resolution import Resolution
from miles.config.rules.methods import check_method
from miles.methods import rollout_loss_types

if TYPE_CHECKING:
    from miles.config.jobs import JobSpec

STEP_STRATEGIES = "miles.sampling.step_strategies."


def check_reference_and_ema(res: Resolution, job: JobSpec) -> None:
    if not job.trains:
        return
    ref = res["ref_mode"]
    if res["diffusion_kl_beta"] > 0 and ref == "none":
        res.fail(f"{res.show('diffusion_kl_beta')} needs a reference model, but {res.show('ref_mode')}")
    if ref == "lora_base" and not res["use_lora"]:
        res.fail(f"{res.show('ref_mode')} uses the LoRA base model as the reference: it requires --use-lora")
    if ref == "ema" and not res["use_ema"]:
        res.fail(f"{res.show('ref_mode')} (auto under --loss-type nft) requires --use-ema")
    if res["ema_rollout_policy"] == "ema" and not res["use_ema"]:
        res.fail(f"{res.show('ema_rollout_policy')} requires --use-ema")
    if res["use_ema"] and ref != "ema" and res["ema_rollout_policy"] != "ema":
        res.fail(
            f"{res.show('use_ema')} keeps an EMA copy nobody reads: add --ref-mode ema or --ema-rollout-policy ema"
        )


def check_sampler(res: Resolution, job: JobSpec) -> None:
    num_steps = res["diffusion_num_steps"]
    if res["diffusion_num_sde_steps"] > num_steps:
        res.fail(f"{res.show('diffusion_num_sde_steps')} exceeds {res.show('diffusion_num_steps')}")
    window = res["diffusion_sde_window_range"]
    if window is not None and (window[0] < 0 or window[1] > num_steps):
        res.fail(f"{res.show('diffusion_sde_window_range')} must lie within [0, {num_steps}] (--diffusion-num-steps)")
    candidates = res["diffusion_sde_candidate_steps"]
    if candidates is not None:
        bad = [c for c in candidates if not 0 <= c < num_steps]
        if bad:
            res.fail(
                f"{res.show('diffusion_sde_candidate_steps')}: steps {bad} are outside [0, {num_steps}) "
                f"(--diffusion-num-steps {num_steps})"
            )
    strategy = res["diffusion_step_strategy_path"] or ""
    if strategy.endswith(".epoch_global_random_choice") and candidates is None:
        res.fail(f"{res.show('diffusion_step_strategy_path')} requires --diffusion-sde-candidate-steps")
    stochastic = res["diffusion_sde_type"] != "ode" and res["diffusion_noise_level"] > 0
    if strategy.endswith(".sde_window") and stochastic and res["diffusion_num_sde_steps"] == 0:
        res.fail(f"{res.show('diffusion_step_strategy_path')} needs --diffusion-num-sde-steps > 0 (the window size)")
    if strategy.endswith(".mix_grpo_window") and stochastic and res["diffusion_num_sde_steps"] == 0:
        res.fail(f"{res.show('diffusion_step_strategy_path')} needs --diffusion-num-sde-steps > 0 (the window size)")
    stock = not strategy or strategy.startswith(STEP_STRATEGIES)
    if stock and not strategy.endswith(".mix_grpo_window"):
        for dest in ("diffusion_sde_window_interval", "diffusion_sde_window_stride"):
            if res.explicit(dest):
                res.fail(
                    f"{res.show(dest)} moves the window of the mix_grpo_window strategy, which "
                    f"{res.show('diffusion_step_strategy_path')} is not"
                )
    ratio = res["diffusion_post_sde_steps_ratio"]
    if ratio is not None and ratio <= 0:
        res.fail(f"{res.show('diffusion_post_sde_steps_ratio')} must be in (0, 1]")
    if res["diffusion_shared_prefix"] and res["rollout_microgroup_size"] == 1:
        res.fail(
            f"{res.show('diffusion_shared_prefix')} shares a prefix among the samples of a microgroup, and "
            f"{res.show('rollout_microgroup_size')} has one sample each"
        )
    if strategy.endswith(".sde_window"):
        lo, hi = window if window is not None else (0, num_steps)
        if res["diffusion_num_sde_steps"] > hi - lo:
            res.fail(
                f"{res.show('diffusion_num_sde_steps')} does not fit the SDE window [{lo}, {hi}) "
                "(--diffusion-sde-window-range)"
            )


def check_advantages(res: Resolution, job: JobSpec) -> None:
    """gardo's advantage is `(r - group mean) * m` (no std, the prompt's own mean): the group-statistics flags of
    grpo would be ignored, so they are refused with it."""
    if res["advantage_estimator"] != "gardo":
        return
    for dest in ("disable_grpo_std_normalization", "globalize_reward_mean", "globalize_reward_std"):
        if res[dest]:
            res.fail(
                f"{res.show(dest)} changes grpo's group statistics; {res.show('advantage_estimator')} uses the "
                "prompt's mean and no std"
            )
    if res["custom_reward_post_process_path"] is not None:
        res.fail(
            f"{res.show('custom_reward_post_process_path')} replaces the advantage estimator, so "
            f"{res.show('advantage_estimator')} would not run"
        )


def check_dmd2(res: Resolution, job: JobSpec) -> None:
    if not job.distills:
        return
    timesteps = res["dmd2_student_timesteps"]
    if any(a <= b for a, b in pairwise(timesteps)):
        res.fail(f"{res.show('dmd2_student_timesteps')} must be strictly decreasing (noise first)")
    if res["dmd2_min_step_ratio"] >= res["dmd2_max_step_ratio"]:
        res.fail(f"{res.show('dmd2_min_step_ratio')} must be below {res.show('dmd2_max_step_ratio')}")


ROLLOUT_LOSSES = rollout_loss_types()  # the methods that train on rollout pairs (miles.methods)
PAIR_HOOKS = (
    "custom_convert_samples_to_train_data_path",
    "custom_expand_samples_to_train_pairs_path",
    "custom_prepare_train_batch_path",
)


def check_train_hooks(res: Resolution, job: JobSpec) -> None:
    """The trainer's hooks are set only where it calls them (miles.training.custom_hooks, methods.custom)."""
    if not job.trains:
        return
    loss = res["loss_type"]
    if not job.trains_on_rollouts or loss not in ROLLOUT_LOSSES:
        for dest in PAIR_HOOKS:
            if res[dest] is not None:
                res.fail(
                    f"{res.show(dest)} works on rollout samples and train pairs, "
                    f"which `miles {job.command}` with --loss-type {loss} does not train on"
                )


RULES = (check_reference_and_ema, check_method, check_sampler, check_advantages, check_dmd2, check_train_hooks)
