"""LoRA adapters on the trainer."""

from __future__ import annotations

from miles.config.catalog._common import flag_maker
from miles.config.flags import BOOL, INT, STR, STR_LIST, Flag

GROUP = "LoRA"
_f = flag_maker(GROUP)

FLAGS: list[Flag] = [
    _f("use-lora", BOOL, False, "Train a single LoRA adapter instead of the full weights."),
    _f("lora-rank", INT, 64, "LoRA rank.", min=1),
    _f("lora-alpha", INT, 64, "LoRA alpha (scaling numerator).", min=1),
    _f(
        "lora-target-modules",
        STR_LIST,
        None,
        "Comma-separated module names to adapt; default: the model family's targets.",
    ),
    _f(
        "lora-init-weights",
        STR,
        "gaussian",
        "LoRA init scheme; kaiming-uniform selects PEFT's default, other PEFT names pass through.",
    ),
    _f(
        "lora-ipc-weight-sync",
        BOOL,
        False,
        "Sync only the LoRA A/B matrices and let the engine merge them. Requires --use-lora and --colocate.",
    ),
]
