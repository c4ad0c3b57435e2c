"""The job table: one row per job, as `miles.methods` is for the training methods and `miles.rewards` for the
rewards. Torch-free (the CLI, the config and the preflight read it before anything heavy is imported).

Each job is one `JobSpec` subclass in `JOBS`, keyed by the name users give `--job` and recipes give `job:`. Its
class-level properties say what it does: which phases run (engines, scoring, training), what it saves, how it
evaluates, which debug modes it has, its command and its driver. Everything outside this module reads those
properties, never a job's name: the CLI registers one command per row (`miles_cli.main`), the runtime runs
`driver` (`miles.runtime.dispatch`), the placement, the preflight, the evaluation schedule, the flag catalogue's
job scopes and the rules read the rest. A new job is one row here plus its driver module.

Shared flags and rules live once (the catalogue and `miles.config.rules`). Settings that differ per job are
class-level "auto" values, resolved by the single `resolve_auto_defaults` step; a job's own extra rules are listed
on its class. What lives on higher floors (the driver) is named by a `module:function` string.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING, ClassVar, Literal

from miles import methods
from miles.methods import METHODS

if TYPE_CHECKING:
    from miles.config.resolution import Resolution

Rule = Callable[["Resolution", "JobSpec"], None]

# How a job evaluates its eval sets (`JobSpec.evaluation`, read by `miles.config.eval_schedule`).
EVAL_ONCE = "once"  # every eval set, once: the job is an evaluation
EVAL_PERIODIC = "periodic"  # after the last step, and every --eval-interval N steps
Evaluation = Literal["once", "periodic"]


class JobSpec:
    """A job: what the loop of the core concepts runs, and which of its phases are on (one row of `JOBS`)."""

    name: ClassVar[str]  # what `--job` and a recipe's `job:` say
    summary: ClassVar[str]  # the command's help line
    # The command line and the runtime.
    command: ClassVar[str]  # how the user types it, e.g. "train rl"
    cli_group: ClassVar[str | None] = None  # "train": a subcommand of `miles train`; None: a top-level command
    takes_rollout_file: ClassVar[bool] = False  # its command's argument is the one rollout file it trains on
    driver: ClassVar[str]  # "module:function", a `run(resolved) -> int | None` imported only when the job starts
    # Auto settings, resolved by `resolve_auto_defaults`.
    auto_loss_type: ClassVar[str | None] = None
    allowed_loss_types: ClassVar[tuple[str, ...]] = ()
    force_train_only: ClassVar[bool] = False
    force_rollout_only: ClassVar[bool] = False
    # Which phases of the loop run.
    starts_engines: ClassVar[bool] = False  # rollout engines and their manager run (unless --train-only)
    generates: ClassVar[bool] = False  # rollout engines sample trajectories (needs the batch knobs)
    trains: ClassVar[bool] = False
    scores: ClassVar[bool] = False  # needs a reward
    alternates_rollout_and_training: ClassVar[bool] = False  # its loop syncs weights from trainer to engines
    needs_prompt_data: ClassVar[bool] = False  # reads --prompt-data (the default data source, or dataset rows)
    needs_eval_data: ClassVar[bool] = False
    trainer_roles: ClassVar[tuple[str, ...]] = ("actor",)
    # What it trains on, and what it keeps.
    trains_on_rollouts: ClassVar[bool] = False  # rollout samples, its own or saved (--load-debug-rollout-data)
    trains_on_dataset: ClassVar[bool] = False  # dataset rows, encoded once in the job's own process (no engines)
    distills: ClassVar[bool] = False  # a few-step student against a frozen teacher and a critic group (DMD2)
    saves_checkpoints: ClassVar[bool] = False  # --save writes checkpoints (and exports), --load resumes from one
    reuses_recipes: ClassVar[bool] = False  # runs under any job's recipe; else only under its own job's
    # How it evaluates (`miles.config.eval_schedule`).
    evaluation: ClassVar[Evaluation | None] = None  # None: eval sets it is given are kept, unused
    step_unit: ClassVar[str] = "rollout"  # what --eval-interval (and the other intervals) count
    evaluates_before_first_step: ClassVar[bool] = True  # with --eval-interval (unless --skip-eval-before-train)
    gold_reward: ClassVar[bool] = False  # scores its eval samples with a held-out gold reward (--gold-rm-type)
    runs_ci_check: ClassVar[bool] = False  # runs `miles.runtime.ci_check` at its end (--ci-test)
    # Its debug modes.
    has_rollout_only_mode: ClassVar[bool] = False  # --debug-rollout-only: generate and score, train nothing
    dumps_rollouts: ClassVar[bool] = False  # --save-debug-rollout-data (and --dump-details)
    dumps_train_data: ClassVar[bool] = False  # --save-debug-train-data
    extra_rules: ClassVar[tuple[Rule, ...]] = ()

    @property
    def guards_rewards(self) -> bool:
        """The reward-hacking guard (--reward-guard) can run: it reads the gold reward of each periodic evaluation."""
        return self.gold_reward and self.evaluation == EVAL_PERIODIC

    @property
    def word(self) -> str:
        """The command's last word, under its `cli_group` (`rl` of `train rl`)."""
        return self.command.split()[-1]

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
    cli_group = "train"
    driver = "miles.runtime.train_rl:run"
    summary = "Flow-GRPO or DiffusionNFT: sample, score, optimize the actor, sync weights."
    auto_loss_type = methods.auto_loss_type("rl")
    allowed_loss_types = methods.loss_types_for("rl")
    starts_engines = generates = trains = scores = needs_prompt_data = True
    alternates_rollout_and_training = trains_on_rollouts = saves_checkpoints = True
    evaluation = EVAL_PERIODIC
    gold_reward = runs_ci_check = True
    has_rollout_only_mode = dumps_rollouts = dumps_train_data = True


class TrainSFT(JobSpec):
    name = "sft"
    command = "train sft"
    cli_group = "train"
    driver = "miles.runtime.train_sft:run"
    summary = "Flow-matching fine-tuning on dataset images (train-only: no engines)."
    auto_loss_type = methods.auto_loss_type("sft")
    allowed_loss_types = methods.loss_types_for("sft")
    force_train_only = True
    trains = needs_prompt_data = True
    trains_on_dataset = saves_checkpoints = True
    evaluation = EVAL_PERIODIC
    step_unit = "iteration"
    runs_ci_check = True


class TrainDMD2(JobSpec):
    name = "dmd2"
    command = "train dmd2"
    cli_group = "train"
    driver = "miles.runtime.train_dmd2:run"
    summary = "DMD2: distill a many-step teacher into a few-step student (critic group + actor)."
    auto_loss_type = methods.auto_loss_type("dmd2")
    allowed_loss_types = methods.loss_types_for("dmd2")
    starts_engines = generates = trains = needs_prompt_data = True
    alternates_rollout_and_training = distills = saves_checkpoints = True
    trainer_roles = ("critic", "actor")
    evaluation = EVAL_PERIODIC
    step_unit = "iteration"
    evaluates_before_first_step = False
    runs_ci_check = True

    def resolve_auto_defaults(self, res: Resolution) -> None:
        super().resolve_auto_defaults(res)
        if res["teacher_checkpoint"] is None and res["hf_checkpoint"] is not None:
            res.derive("teacher_checkpoint", res["hf_checkpoint"])
        if res["dmd2_real_guidance_scale"] is None:
            res.derive("dmd2_real_guidance_scale", res["diffusion_guidance_scale"])


class Eval(JobSpec):
    name = "eval"
    command = "eval"
    driver = "miles.runtime.eval_job:run"
    summary = "Generate for the eval datasets and report reward and metrics (no training)."
    starts_engines = scores = needs_eval_data = True
    reuses_recipes = True
    evaluation = EVAL_ONCE
    gold_reward = runs_ci_check = True


class RolloutOnly(JobSpec):
    name = "rollout-only"
    command = "rollout-only"
    driver = "miles.runtime.rollout_only:run"
    summary = "Sample and score rollouts and save them as rollout_{id}.pt (no training)."
    force_rollout_only = True
    starts_engines = generates = scores = needs_prompt_data = True
    reuses_recipes = True
    has_rollout_only_mode = dumps_rollouts = True


class Replay(JobSpec):
    name = "replay"
    command = "replay"
    takes_rollout_file = True
    driver = "miles.runtime.replay:run"
    summary = "Train on a saved rollout file (rollout_{id}.pt) with no engines started."
    auto_loss_type = methods.auto_loss_type("replay")
    allowed_loss_types = methods.loss_types_for("replay")
    force_train_only = True
    trains = trains_on_rollouts = True
    reuses_recipes = True


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


def jobs_where(having: Callable[[JobSpec], bool]) -> tuple[JobSpec, ...]:
    """The jobs `having` holds for, in table order."""
    return tuple(job for job in JOBS.values() if having(job))


def job_names(having: Callable[[JobSpec], bool]) -> frozenset[str]:
    """The names of the jobs `having` holds for: a flag's job scope (`miles.config.flags.Flag.jobs`), read from the
    table when the catalogue is built."""
    return frozenset(job.name for job in jobs_where(having))
