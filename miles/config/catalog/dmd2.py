"""DMD2 distillation (train dmd2): few-step student, critic (fake score) and frozen teacher."""

from __future__ import annotations

from miles.config.catalog._common import DISTILL_JOBS, flag_maker
from miles.config.flags import BOOL, FLOAT, INT, INT_LIST, PATH, Flag

GROUP = "DMD2"
_f = flag_maker(GROUP)

FLAGS: list[Flag] = [
    _f(
        "teacher-checkpoint",
        PATH,
        None,
        "Frozen teacher pipeline (HF id or dir); default: --hf-checkpoint.",
        jobs=DISTILL_JOBS,
        meta={"default_text": "--hf-checkpoint"},
    ),
    _f(
        "dmd2-student-timesteps",
        INT_LIST,
        [999, 749, 499, 249],
        "Timesteps of the few-step student, each in [0, 999].",
        min=0,
        max=999,
        jobs=DISTILL_JOBS,
    ),
    _f(
        "dmd2-real-guidance-scale",
        FLOAT,
        None,
        "CFG scale of the frozen teacher for the real score; default: --diffusion-guidance-scale.",
        min=0,
        jobs=DISTILL_JOBS,
        meta={"default_text": "--diffusion-guidance-scale"},
    ),
    _f(
        "dmd2-critic-update-ratio",
        INT,
        5,
        "Critic (fake score) steps per student step (two time-scale update rule).",
        min=1,
        jobs=DISTILL_JOBS,
    ),
    _f(
        "dmd2-min-step-ratio",
        FLOAT,
        0.02,
        "Lower end of the timestep range for the distribution-matching loss, as a fraction.",
        min=0,
        max=1,
        jobs=DISTILL_JOBS,
    ),
    _f(
        "dmd2-max-step-ratio",
        FLOAT,
        0.98,
        "Upper end of the timestep range for the distribution-matching loss, as a fraction.",
        min=0,
        max=1,
        jobs=DISTILL_JOBS,
    ),
    _f(
        "dmd2-gan-loss-weight",
        FLOAT,
        0.0,
        "Weight of the GAN loss on the critic's features; 0 turns the GAN head off.",
        min=0,
        jobs=DISTILL_JOBS,
    ),
    _f(
        "dmd2-backward-simulation",
        BOOL,
        True,
        "Produce the student's training inputs by running its own few-step sampler (backward simulation).",
        jobs=DISTILL_JOBS,
    ),
]
