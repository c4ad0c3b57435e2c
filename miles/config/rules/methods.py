"""The rules of each training method (`miles.methods`: each entry names its rule function here and the flags it
owns). `check_method` runs the job's method's rules and refuses a method's own flag under another method."""

from __future__ import annotations

from typing import TYPE_CHECKING

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


def check_method(res: Resolution, job: JobSpec) -> None:
    if not job.trains:
        return
    loss = res["loss_type"]
    for other in METHODS.values():
        for dest in other.own_flags:
            if other.name != loss and res[dest] not in (None, False):
                res.fail(f"{res.show(dest)} applies to --loss-type {other.name} only, not {loss}")
    current = METHODS.get(loss)
    if current is not None and current.rules is not None:
        RULE_FUNCTIONS[current.rules](res, job)


# the table's `rules` names
RULE_FUNCTIONS = {fn.__name__: fn for fn in (check_policy_loss, check_nft, check_custom_loss)}
