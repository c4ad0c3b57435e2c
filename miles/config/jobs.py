"""One base job schema shared by every subcommand, subclassed per job.

Shared flags and rules live once (the catalogue and `miles.config.rules`). Settings that differ per
job are class-level "auto" values, resolved by the single `resolve_auto_defaults` step; a job's own
extra rules are listed on its class.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import ClassVar

from miles import methods
from miles.config.resolution import Resolution
from miles.methods import METHODS

Rule = Callable[[Resolution, "JobSpec"], None]


class JobSpec:
    """A job: what the loop of the core concepts runs, and which of its phases are on."""

    name: ClassVar[str]
    command: ClassVar[str]  # how the user types it, e.g. "train rl"
    summary: ClassVar[str]
    # Auto settings, resolved by `resolve_auto_defaults`.
    auto_loss_type: ClassVar[str | None] = None
    allowed_loss_types: ClassVar[tuple[str, ...]] = ()
    force_train_only: ClassVar[bool] = False
    force_rollout_only: ClassVar[bool] = False
    # Which phases of the loop run.
    generates: ClassVar[bool] = False  # rollout engines sample trajectories (needs the batch knobs)
    trains: ClassVar[bool] = False
    scores: ClassVar[bool] = False  # needs a reward
    needs_prompt_data: ClassVar[bool] = False
    needs_eval_data: ClassVar[bool] = False
    trainer_roles: ClassVar[tuple[str, ...]] = ("actor",)
    extra_rules: ClassVar[tuple[Rule, ...]] = ()

    def resolve_auto_defaults(self, res: Resolution) -> None:
        """Resolve every "auto" value the way this job wants it (one place for all of them)."""
        loss = res["loss_type"]
        if loss is None and self.auto_loss_type is not None:
            res.derive("loss_type", self.auto_loss_type)
        elif loss is not None and self.allowed_loss_types and loss not in self.allowed_loss_types:
            res.fail(
                f"{res.show('loss_type')} cannot be used with `miles {self.command}`: "
                f"it takes --loss-type {' | '.join(self.allowed_loss_types)}"
            )
        elif loss is not None and not self.trains and res.source("loss_type") == "cli":
            res.fail(f"{res.show('loss_type')} means nothing to `miles {self.command}`: it does not train")

        if self.force_train_only:
            if res.explicit("train_only") and not res["train_only"]:
                res.fail(f"`miles {self.command}` always runs train-only: remove {res.show('train_only')}")
            if not res["train_only"]:
                res.derive("train_only", True)
        if self.force_rollout_only and not res["debug_rollout_only"]:
            res.derive("debug_rollout_only", True)

        if res["output_dir"] is None:
            stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
            res.derive("output_dir", f"runs/{self.name}-{stamp}")

        loss = res["loss_type"]
        if res["ref_mode"] is None and self.trains:
            wanted = METHODS[loss].auto_ref_mode(bool(res["use_lora"])) if loss in METHODS else None
            if wanted is not None:
                res.derive("ref_mode", wanted)
            elif res["diffusion_kl_beta"] > 0:
                res.derive("ref_mode", "lora_base")
            else:
                res.derive("ref_mode", "none")


class TrainRL(JobSpec):
    name = "rl"
    command = "train rl"
    summary = "Flow-GRPO or DiffusionNFT: sample, score, optimize the actor, sync weights."
    auto_loss_type = methods.auto_loss_type("rl")
    allowed_loss_types = methods.loss_types_for("rl")
    generates = trains = scores = needs_prompt_data = True


class TrainSFT(JobSpec):
    name = "sft"
    command = "train sft"
    summary = "Flow-matching fine-tuning on dataset images (train-only: no engines)."
    auto_loss_type = methods.auto_loss_type("sft")
    allowed_loss_types = methods.loss_types_for("sft")
    force_train_only = True
    trains = needs_prompt_data = True


class TrainDMD2(JobSpec):
    name = "dmd2"
    command = "train dmd2"
    summary = "DMD2: distill a many-step teacher into a few-step student (critic group + actor)."
    auto_loss_type = methods.auto_loss_type("dmd2")
    allowed_loss_types = methods.loss_types_for("dmd2")
    generates = trains = needs_prompt_data = True
    trainer_roles = ("critic", "actor")

    def resolve_auto_defaults(self, res: Resolution) -> None:
        super().resolve_auto_defaults(res)
        if res["teacher_checkpoint"] is None and res["hf_checkpoint"] is not None:
            res.derive("teacher_checkpoint", res["hf_checkpoint"])
        if res["dmd2_real_guidance_scale"] is None:
            res.derive("dmd2_real_guidance_scale", res["diffusion_guidance_scale"])


class Eval(JobSpec):
    name = "eval"
    command = "eval"
    summary = "Generate for the eval datasets and report reward and metrics (no training)."
    scores = needs_eval_data = True


class RolloutOnly(JobSpec):
    name = "rollout-only"
    command = "rollout-only"
    summary = "Sample and score rollouts and save them as rollout_{id}.pt (no training)."
    force_rollout_only = True
    generates = scores = needs_prompt_data = True


class Replay(JobSpec):
    name = "replay"
    command = "replay"
    summary = "Train on a saved rollout file with no engines started."
    auto_loss_type = methods.auto_loss_type("replay")
    allowed_loss_types = methods.loss_types_for("replay")
    force_train_only = True
    trains = True


JOBS: dict[str, JobSpec] = {
    job.name: job for job in (TrainRL(), TrainSFT(), TrainDMD2(), Eval(), RolloutOnly(), Replay())
}


def job_spec(name: str) -> JobSpec:
    from miles.config.flags import closest
    from miles.core.errors import ConfigError

    try:
        return JOBS[name]
    except KeyError:
        hint = closest(name, JOBS)
        suffix = f" (did you mean {hint!r}?)" if hint else ""
        raise ConfigError(f"unknown job {name!r}{suffix}; jobs: {', '.join(JOBS)}") from None
