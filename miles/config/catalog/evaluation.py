"""Periodic evaluation rollouts."""

from __future__ import annotations

from miles.config.catalog._common import GOLD_JOBS, GUARD_JOBS, flag_maker
from miles.config.flags import BOOL, DOTTED, ENUM, FLOAT, INT, NAMED_PATHS, PATH, STR, Flag

GROUP = "Evaluation"
GUARD_POLICIES = ("off", "warn", "stop", "rollback")
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
    _f("eval-media-key", STR, None, "Media key (column) of eval datasets; default: --media-key."),
    _f("n-samples-per-eval-prompt", INT, 1, "Samples generated per eval prompt.", min=1),
    _f("diffusion-eval-num-steps", INT, None, "Denoising steps for eval; default: --diffusion-num-steps.", min=1),
    _f("skip-eval-before-train", BOOL, False, "Do not run an evaluation before the first training step."),
    _f("eval-reward-key", STR, None, "Key of the eval reward when it is a dict; default: --reward-key."),
    _f(
        "gold-rm-type",
        STR,
        None,
        "A held-out gold reward scored on the eval samples beside the training proxy: a built-in reward type or "
        "the dotted path of a reward function (--custom-rm-path's contract); logged as eval/<name>/gold_reward_mean.",
        jobs=GOLD_JOBS,
    ),
    _f("gold-reward-key", STR, None, "Key of the gold reward when it is a dict.", jobs=GOLD_JOBS),
    _f(
        "reward-guard",
        ENUM,
        "off",
        "What the reward-hacking guard does when the gold reward falls (or diversity collapses): warn, stop the job, "
        "or rollback to the checkpoint with the best gold reward and end there (that checkpoint is exported).",
        choices=GUARD_POLICIES,
        jobs=GUARD_JOBS,
    ),
    _f(
        "reward-guard-patience",
        INT,
        2,
        "Evaluations in a row whose gold reward is below the best by more than the tolerance before the guard acts.",
        min=1,
        jobs=GUARD_JOBS,
    ),
    _f(
        "reward-guard-tolerance",
        FLOAT,
        0.0,
        "How far below its best the mean gold reward may fall before an evaluation counts against the guard.",
        min=0,
        jobs=GUARD_JOBS,
    ),
    _f(
        "reward-guard-min-diversity",
        FLOAT,
        None,
        "The guard also acts when rollout/diversity falls below this fraction of its first rollout's value.",
        min=0,
        max=1,
        jobs=GUARD_JOBS,
    ),
]
