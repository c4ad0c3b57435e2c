"""Rules of the rollout hooks and backends: each is accepted only where miles calls it (torch-free).

See miles.rollout.rollout_hooks (rollout, eval, generate and log hooks), miles.sampling.sde_backends
(--sde-step-backend-path, --diffusion-log-prob-no-const) and miles.training.model.ModelBackend.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles.config.backends import BUILTIN_ROLLOUTS, is_builtin_rollout
from miles.config.resolution import Resolution

if TYPE_CHECKING:
    from miles.config.jobs import JobSpec

# dest -> (the jobs that call it, what it is called on)
_WHERE: dict[str, tuple[tuple[str, ...], str]] = {
    "rollout_function_path": (("rl", "rollout-only", "eval"), "the rollouts of `train rl` and `rollout-only`"),
    "eval_function_path": (("rl", "eval", "sft"), "the eval rollouts of `train rl`, `train sft` and `eval`"),
    "custom_generate_function_path": (
        ("rl", "rollout-only", "eval", "sft"),
        "the engine requests of `train rl`, `rollout-only`, `eval` and the eval of `train sft`",
    ),
    "custom_rollout_log_function_path": (("rl", "rollout-only"), "the rollouts of `train rl` and `rollout-only`"),
    "custom_eval_rollout_log_function_path": (
        ("rl", "eval", "sft"),
        "the eval rollouts of `train rl`, `train sft` and `eval`",
    ),
    "model_backend_path": (("rl", "sft", "dmd2", "replay"), "the trainer's model load"),
    "sde_step_backend_path": (
        ("rl", "rollout-only", "replay"),
        "the SDE steps of the rollout engine and the trainer's log-prob recompute",
    ),
}


def _set(res: Resolution, dest: str) -> bool:
    value = res[dest]
    if dest in ("rollout_function_path", "eval_function_path"):
        return not is_builtin_rollout(value)
    return value is not None


def check_rollout_hooks(res: Resolution, job: JobSpec) -> None:
    for dest in ("rollout_function_path", "eval_function_path"):
        value = res[dest]
        if value and str(value).startswith("miles.") and not is_builtin_rollout(value):
            res.fail(
                f"{res.show(dest)} is not a miles rollout function; the built-in rollout is any of "
                f"{', '.join(sorted(BUILTIN_ROLLOUTS))}, anything else must be your own function"
            )
    for dest, (jobs, what) in _WHERE.items():
        if _set(res, dest) and job.name not in jobs:
            res.fail(f"{res.show(dest)} applies to {what}, which `miles {job.command}` does not run")
    if res["buffer_filter_path"] is not None and res["data_source_path"] is None:
        res.fail(
            f"{res.show('buffer_filter_path')}: nothing puts groups back into the default data source's buffer "
            "(miles has no partial rollouts); it needs a --data-source-path subclass of "
            "RolloutDataSourceWithBuffer that calls add_samples"
        )
    if job.generates and res["rollout_backend"] == "sglang":
        for dest in ("sde_step_backend_path", "diffusion_log_prob_no_const"):
            if res[dest]:
                res.fail(
                    f"{res.show(dest)} with {res.show('rollout_backend')}: the sglang engine computes its own "
                    "log-probs, so the trainer could not match them; use --rollout-backend diffusers"
                )


RULES = (check_rollout_hooks,)
