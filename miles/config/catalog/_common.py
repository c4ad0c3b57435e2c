"""Helpers shared by the catalogue modules (torch-free)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from miles.config.flags import (
    DOTTED,
    ENUM,
    FLOAT,
    INT,
    INT_LIST,
    INT_RANGE,
    JSON,
    NAMED_PATHS,
    PATH,
    STR,
    STR_LIST,
    WEIGHTS,
    Flag,
)
from miles.config.jobs import job_names
from miles.methods import METHODS

# Job scopes used by `Flag.jobs` (None = every job), read from the job table (`miles.config.jobs`) and the method
# table (`miles.methods`).
DISTILL_JOBS = job_names(lambda job: job.distills)
DATASET_JOBS = job_names(lambda job: job.trains_on_dataset)
NFT_JOBS = frozenset(METHODS["nft"].jobs)  # the jobs whose --loss-type takes nft
DPO_JOBS = frozenset(METHODS["dpo"].jobs)  # the jobs whose --loss-type takes dpo
# the jobs that train on rollouts with a method whose trained forward is the rollout's guided one (CFG in training)
GUIDED_TRAIN_JOBS = job_names(
    lambda job: job.trains_on_rollouts and any(m.guided_forward and job.name in m.jobs for m in METHODS.values())
)
ENGINE_JOBS = job_names(lambda job: job.starts_engines)
LOOP_JOBS = job_names(lambda job: job.alternates_rollout_and_training)
CHECKPOINT_JOBS = job_names(lambda job: job.saves_checkpoints)
GOLD_JOBS = job_names(lambda job: job.gold_reward)
GUARD_JOBS = job_names(lambda job: job.guards_rewards)

_METAVARS = {
    INT: "INT",
    FLOAT: "FLOAT",
    STR: "TEXT",
    PATH: "PATH",
    DOTTED: "pkg.module.fn",
    JSON: "JSON",
    INT_RANGE: "lo,hi",
    INT_LIST: "1,2,3",
    STR_LIST: "a,b",
    NAMED_PATHS: "NAME PATH",
    WEIGHTS: "name=w,...",
}


def default_metavar(kind: str, choices: tuple[str, ...] | None) -> str | None:
    """The metavar shown in --help when a flag does not name one."""
    if kind == ENUM and choices:
        return "[" + "|".join(choices) + "]"
    if kind == STR_LIST and choices:
        return "[" + "|".join(choices) + "],..."
    return _METAVARS.get(kind)


def flag_maker(group: str) -> Callable[..., Flag]:
    """Return `make(name, kind, default=None, text="", **kwargs) -> Flag` bound to one help panel.

    It fills in `group` and, when none is given, a metavar derived from the kind.
    """

    def make(name: str, kind: str, default: Any = None, text: str = "", **kwargs: Any) -> Flag:
        if "metavar" not in kwargs:
            kwargs["metavar"] = default_metavar(kind, kwargs.get("choices"))
        return Flag(name=name, kind=kind, default=default, help=text, group=group, **kwargs)

    return make
