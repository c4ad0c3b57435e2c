"""Per-trainer args: which trainers a run has, and each one's copy of the args.

A trainer class never knows its role: a role is only a set of argument overrides. Every job has one
trainer, the `actor`, with no overrides, except `train dmd2`, whose critic group (the fake score,
next to the frozen teacher) is a second trainer on the same trainer class with its own overrides.
The list is in run order: groups run one after the other each iteration.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from miles.config.args import Args, override_source
from miles.config.flags import closest
from miles.core.errors import ConfigError
from miles.methods import METHODS


@dataclass(frozen=True)
class TrainerConfig:
    """A trainer of the run: its role and the arguments it overrides."""

    role: str
    overrides: dict[str, Any] = field(default_factory=dict)


def critic_defaults(args: Args, critic_loss: str) -> dict[str, Any]:
    """What the critic group (DMD2's) always differs in: it is a fake score initialised from the teacher."""
    overrides: dict[str, Any] = {
        "loss_type": critic_loss,
        "hf_checkpoint": args.teacher_checkpoint or args.hf_checkpoint,
        "ref_mode": "none",
        "use_ema": False,
        "ema_rollout_policy": "live",
    }
    if args.save is not None:
        overrides["save"] = f"{args.save.rstrip('/')}/critic"
    if args.load is not None:
        overrides["load"] = f"{args.load.rstrip('/')}/critic"
    return overrides


def compute_trainer_configs(args: Args) -> list[TrainerConfig]:
    """The run's trainers, in run order."""
    actor = TrainerConfig("actor", {})
    known = METHODS.get(args.loss_type)  # the method table (miles.methods): DMD2 trains against a critic group
    critic_loss = known.critic if known is not None and args.job in known.jobs else None
    if critic_loss is None:
        return [actor]
    overrides = critic_defaults(args, critic_loss)
    overrides.update(copy.deepcopy(args.trainer_overrides.get("critic", {})))
    if overrides["loss_type"] != critic_loss:
        raise ConfigError(f"trainers.critic.loss_type must be {critic_loss}, got {overrides['loss_type']!r}")
    # Keep only what really differs, so the printed table shows the critic's own values.
    overrides = {k: v for k, v in overrides.items() if getattr(args, k) != v}
    return [TrainerConfig("critic", overrides), actor]


def compute_trainer_args(args: Args, trainer: TrainerConfig) -> Args:
    """A deep copy of `args` with the trainer's overrides applied; `args` is left untouched.

    Overriding an argument the schema does not know is rejected.
    """
    unknown = [key for key in trainer.overrides if key not in args]
    if unknown:
        hints = {key: closest(key, list(args)) for key in unknown}
        detail = ", ".join(f"{k!r}" + (f" (did you mean {h!r}?)" if h else "") for k, h in hints.items())
        raise ConfigError(f"trainer {trainer.role!r} overrides unknown argument(s): {detail}")
    return args.with_values(trainer.overrides, override_source(trainer.role))
