"""Checkpoint saving and resuming."""

from __future__ import annotations

from miles.config.catalog._common import CHECKPOINT_JOBS, flag_maker
from miles.config.flags import BOOL, INT, PATH, Flag

GROUP = "Checkpointing"
_f = flag_maker(GROUP)

FLAGS: list[Flag] = [
    _f("save", PATH, None, "Directory to save checkpoints to."),
    _f("save-interval", INT, None, "Save every N rollouts. Requires --save.", min=1),
    _f("no-save-optim", BOOL, False, "Do not save optimizer state: smaller checkpoints, but no exact resume."),
    _f("load", PATH, None, "Directory to resume from."),
    _f("ckpt-step", INT, None, "Checkpoint step to load; default: latest_checkpointed_iteration.txt.", min=0),
    _f("no-load-optim", BOOL, False, "Do not restore optimizer state when loading."),
    _f("no-load-rng", BOOL, False, "Do not restore RNG state when loading."),
    _f(
        "export-interval",
        INT,
        None,
        "Export every N rollouts (iterations in train sft and train dmd2) and at the end to "
        "<output-dir>/exports/rollout_<n>/ (iter_<n>/), each part written atomically: the "
        "LoRA adapter in diffusers format (lora/, with --use-lora) and the merged pipeline (pipeline/, with "
        "--export-merged or without LoRA); exports/latest.txt names the newest complete one.",
        min=1,
        jobs=CHECKPOINT_JOBS,
    ),
    _f(
        "export-merged",
        BOOL,
        False,
        "With --export-interval and --use-lora: also write the merged pipeline beside each adapter.",
        jobs=CHECKPOINT_JOBS,
    ),
]
