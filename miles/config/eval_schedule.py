"""When a job evaluates its eval sets (torch-free; the rules, the preflight, the loops and `inspect-config` read it).

A training job given eval data (`--eval-prompt-data` or `--eval-config`) always evaluates after its last rollout
(iteration); with `--eval-interval N` also before the first (unless `--skip-eval-before-train`) and every N. Eval data
is never accepted and then ignored: a training job that starts no engine (saved rollouts) or trains nothing
(`--debug-rollout-only`) does not evaluate them, and the config rules warn that it does not (and refuse an
`--eval-interval` there). `miles eval` evaluates them; `rollout-only` and `replay` reuse a training recipe's eval sets
without evaluating them (a recipe's values for another job are kept, unused). Which job does which is its row of the
job table (`miles.config.jobs`: `evaluation`, `step_unit`, `evaluates_before_first_step`).
"""

from __future__ import annotations

from typing import Any

from miles.config.jobs import EVAL_ONCE, EVAL_PERIODIC, job_spec
from miles.config.resolution import Resolution


def _value(args: Any, name: str) -> Any:
    """A flag's value from resolved `Args` (attributes) or a `Resolution` (items)."""
    return args[name] if isinstance(args, Resolution) else getattr(args, name)


def has_eval_data(args: Any) -> bool:
    return bool(_value(args, "eval_prompt_data")) or _value(args, "eval_config") is not None


def trains_on_saved_rollouts(args: Any, job: str) -> bool:
    """`train rl` on saved rollouts (`--load-debug-rollout-data`, `miles replay`): no engine starts."""
    return job_spec(job).trains_on_rollouts and _value(args, "load_debug_rollout_data") is not None


def not_evaluated_reason(args: Any, job: str) -> str | None:
    """Why `job` does not evaluate the eval sets it was given (None: it does, or it has none)."""
    if not has_eval_data(args):
        return None
    evaluation = job_spec(job).evaluation
    if evaluation == EVAL_ONCE:
        return None
    if evaluation != EVAL_PERIODIC:
        return f"`miles {job}` generates (and scores) its prompts only"
    if trains_on_saved_rollouts(args, job):
        return "training on saved rollouts starts no engine"
    if _value(args, "debug_rollout_only"):
        return "--debug-rollout-only generates and scores, and trains nothing"
    return None


def evaluates(args: Any, job: str) -> bool:
    """Whether `job` runs evaluations of its eval sets."""
    return has_eval_data(args) and not_evaluated_reason(args, job) is None


def schedule_text(args: Any, job: str) -> str:
    """When the job evaluates, in words (`inspect-config` prints it)."""
    if not has_eval_data(args):
        return "no eval sets (--eval-prompt-data / --eval-config)"
    spec = job_spec(job)
    if spec.evaluation == EVAL_ONCE:
        return "every eval set, once"
    reason = not_evaluated_reason(args, job)
    if reason is not None:
        return f"not evaluated: {reason}"
    unit = spec.step_unit
    interval = _value(args, "eval_interval")
    if not interval:
        return f"after the last {unit} only (set --eval-interval N for a curve)"
    before = spec.evaluates_before_first_step and not _value(args, "skip_eval_before_train")
    first = f"before the first {unit}, " if before else ""
    return f"{first}every {interval} {unit}s and after the last"
