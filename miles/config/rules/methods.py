"""The rules of each training method (`miles.methods`: each entry names its rule function here and the flags it
owns). `check_method` runs the job's method's rules and refuses a method's own flag under another method."""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles.config.catalog import FLAGS_BY_DEST
from miles.config.resolution import Resolution
from miles.methods import METHODS

if TYPE_CHECKING:
    from miles.config.jobs import JobSpec


def check_policy_loss(res: Resolution, job: JobSpec) -> None:
    """Flow-GRPO trains on stochastic transitions: a rollout must record some."""
    if not job.generates:
        return
    strategy = res["diffusion_step_strategy_path"] or ""
    if res["diffusion_sde_type"] == "ode":
        res.fail(
            f"--loss-type policy_loss trains on stochastic steps, but {res.show('diffusion_sde_type')} "
            "samples none (use --loss-type nft for ODE rollouts)"
        )
    if res["diffusion_grpo_guard"] and res["diffusion_sde_type"] != "sde":
        res.fail(
            f"{res.show('diffusion_grpo_guard')} normalises the Flow-SDE step's Gaussian log-ratio, and "
            f"{res.show('diffusion_sde_type')} has no such density (CPS drops its 1/(2 s^2)); "
            "use --diffusion-sde-type sde"
        )
    if res["diffusion_num_sde_steps"] == 0 and not strategy:
        res.fail(
            "--loss-type policy_loss needs trained SDE steps: set --diffusion-num-sde-steps N "
            "or --diffusion-step-strategy-path (both are unset)"
        )


def check_nft(res: Resolution, job: JobSpec) -> None:
    if res["diffusion_kl_beta"] > 0 and not res["use_lora"]:
        res.fail(
            f"{res.show('diffusion_kl_beta')} under --loss-type nft is a KL to the LoRA base model (adapters off): "
            "it requires --use-lora"
        )


def check_custom_loss(res: Resolution, job: JobSpec) -> None:
    if res["custom_loss_function_path"] is None:
        res.fail(f"{res.show('loss_type')} requires --custom-loss-function-path")


# flags that shape the GRPO advantages or add a KL term: dpo reads neither (it ranks each group by its raw reward,
# and its reference is in the loss), so a value other than the default would be ignored
DPO_UNREAD = (
    "advantage_estimator",
    "globalize_reward_mean",
    "globalize_reward_std",
    "disable_grpo_std_normalization",
    "custom_reward_post_process_path",
    "diffusion_kl_beta",
)


def check_dpo(res: Resolution, job: JobSpec) -> None:
    """DPO needs a reference, and online it pairs within whole prompt groups: every optimizer window must hold
    complete groups of at least two samples."""
    if res["ref_mode"] == "none":
        res.fail(
            f"--loss-type dpo compares the policy with a reference, but {res.show('ref_mode')}: use --ref-mode "
            "frozen (a frozen copy of the start weights), lora_base (with --use-lora) or ema (with --use-ema)"
        )
    if not res["diffusion_dpo_beta"] > 0:
        res.fail(f"{res.show('diffusion_dpo_beta')} must be > 0 (the loss's inverse temperature)")
    if job.trains_on_dataset:
        return  # offline: preference rows, no groups and no rewards
    for dest in DPO_UNREAD:
        if res[dest] != FLAGS_BY_DEST[dest].default:
            res.fail(
                f"{res.show(dest)} is not read by --loss-type dpo, which pairs each group's best and worst raw reward "
                "(--reward-key) and has its reference in the loss; remove it"
            )
    for dest in ("micro_batch_size_sample", "micro_batch_size_tstep"):
        if res[dest] is not None:
            res.fail(
                f"{res.show(dest)} tiles samples x SDE timesteps; --loss-type dpo trains (winner, loser) pairs: "
                "use --micro-batch-size"
            )
    n, gbs = res["n_samples_per_prompt"], res["global_batch_size"]
    if n < 2:
        res.fail(
            f"--loss-type dpo pairs the best and the worst sample of each prompt group, but "
            f"{res.show('n_samples_per_prompt')} makes groups of one: use 2 or more"
        )
    if gbs is not None and gbs % n:
        res.fail(
            f"--loss-type dpo pairs within whole prompt groups, but {res.show('global_batch_size')} is not a multiple "
            f"of {res.show('n_samples_per_prompt')}, so an optimizer window would split a group"
        )


def check_cfg_uncond_grad(res: Resolution, job: JobSpec) -> None:
    """`--diffusion-cfg-uncond-grad detach` changes the gradient of the trained CFG forward: the job must train on
    rollouts with a method whose trained forward is the rollout's guided one (`guided_forward` in the method table),
    and the family must train with CFG (the family's `check_settings`). A recipe's detach that another setting makes
    inapplicable falls back to full with a warning (`Resolution.not_applicable`); the user's own is refused."""
    if res["diffusion_cfg_uncond_grad"] == "full" or job.name not in FLAGS_BY_DEST["diffusion_cfg_uncond_grad"].jobs:
        return  # a recipe's value for another job is kept, unused (the CLI refuses it by the flag's job scope)
    dest = "diffusion_cfg_uncond_grad"
    if res["debug_rollout_only"]:
        res.not_applicable(dest, f"{res.show('debug_rollout_only')} trains nothing")
        return
    known = METHODS.get(res["loss_type"])
    if known is not None and not known.guided_forward:
        guided = ", ".join(m.name for m in METHODS.values() if m.guided_forward and job.name in m.jobs)
        res.not_applicable(
            dest,
            f"{res.show('loss_type')} trains an unguided forward (no CFG branch to detach)",
            f"it applies to --loss-type {guided}",
        )


def check_method(res: Resolution, job: JobSpec) -> None:
    check_cfg_uncond_grad(res, job)
    if not job.trains:
        return
    loss = res["loss_type"]
    for other in METHODS.values():
        for dest in other.own_flags:
            if other.name != loss and res[dest] != FLAGS_BY_DEST[dest].default:
                res.fail(f"{res.show(dest)} applies to --loss-type {other.name} only, not {loss}")
    current = METHODS.get(loss)
    if current is not None and current.rules is not None:
        RULE_FUNCTIONS[current.rules](res, job)


# the table's `rules` names
RULE_FUNCTIONS = {fn.__name__: fn for fn in (check_policy_loss, check_nft, check_custom_loss, check_dpo)}
