"""Periodic evaluation rollouts."""

from __future__ import annotations

from miles.config.catalog._common import flag_maker
from miles.config.flags import BOOL, DOTTED, INT, NAMED_PATHS, PATH, STR, Flag

GROUP = "Evaluation"
_f = flag_maker(GROUP)

FLAGS: list[Flag] = [
    _f("eval-interval", INT, None, "Evaluate every N rollouts; requires eval datasets to be configured.", min=1),
    _f("eval-prompt-data", NAMED_PATHS, None, "Eval datasets as repeatable NAME PATH pairs."),
    _f("eval-config", PATH, None, "OmegaConf YAML/JSON eval config; overrides --eval-prompt-data."),
    _f(
        "eval-function-path",
        DOTTED,
        None,
        "Eval rollout function (rollout shape, evaluation=True); default: --rollout-function-path.",
    ),
    _f("eval-input-key", STR, None, "JSONL prompt key of eval datasets; default: --input-key."),
    _f("n-samples-per-eval-prompt", INT, 1, "Samples generated per eval prompt.", min=1),
    _f("diffusion-eval-num-steps", INT, None, "Denoising steps for eval; default: --diffusion-num-steps.", min=1),
    _f("skip-eval-before-train", BOOL, False, "Do not run an evaluation before the first training step."),
    _f("eval-reward-key", STR, None, "Key of the eval reward when it is a dict; default: --reward-key."),
]
