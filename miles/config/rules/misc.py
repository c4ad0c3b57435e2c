"""Precision, LoRA and environment rules."""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles.config.jobs import jobs_where
from miles.config.resolution import Resolution

if TYPE_CHECKING:
    from miles.config.jobs import JobSpec

_LORA_KNOBS = ("lora_rank", "lora_alpha", "lora_target_modules", "lora_init_weights")


def check_precision(res: Resolution, job: JobSpec) -> None:
    dit = res["sglang_args"].get("dit_precision")
    if dit is not None and str(dit) != res["diffusion_forward_dtype"]:
        res.fail(
            f"{res.show('diffusion_forward_dtype')} must equal --sglang-dit-precision {dit}: "
            "the engine and the trainer must run the DiT in the same dtype"
        )


def check_lora(res: Resolution, job: JobSpec) -> None:
    if res["use_lora"]:
        return
    stray = [dest for dest in _LORA_KNOBS if res.explicit(dest)]
    if stray and job.trains:
        res.warn(f"{', '.join(res.show(d) for d in stray)} ignored: --use-lora is off")


def check_env_vars(res: Resolution, job: JobSpec) -> None:
    for key, value in res["train_env_vars"].items():
        if not isinstance(value, (str, int, float, bool)):
            res.fail(f"--train-env-vars: the value of {key!r} must be a string or number, got {value!r}")


def check_ci(res: Resolution, job: JobSpec) -> None:
    """--ci-test, --ci-metric-checker-key and --ci-metric-checker-threshold go together."""
    key, threshold = res["ci_metric_checker_key"], res["ci_metric_checker_threshold"]
    if not res["ci_test"]:
        stray = [dest for dest in ("ci_metric_checker_key", "ci_metric_checker_threshold") if res[dest] is not None]
        if stray:
            res.fail(f"{', '.join(res.show(d) for d in stray)} requires --ci-test (the CI metric check)")
        return
    missing = [
        flag
        for flag, value in (("--ci-metric-checker-key", key), ("--ci-metric-checker-threshold", threshold))
        if value is None
    ]
    if missing:
        res.fail(f"{res.show('ci_test')} checks one metric: it requires {' and '.join(missing)}")
    if not job.runs_ci_check:  # the jobs that run `miles.runtime.ci_check` at their end
        checked = ", ".join(j.name for j in jobs_where(lambda j: j.runs_ci_check))
        res.fail(f"{res.show('ci_test')}: `miles {job.command}` runs no CI metric check (jobs: {checked})")


def check_exports(res: Resolution, job: JobSpec) -> None:
    if res["export_merged"] and res["export_interval"] is None:
        res.fail(f"{res.show('export_merged')} sets what the periodic exports hold: it needs --export-interval N")
    if res["export_merged"] and not res["use_lora"]:
        res.fail(
            f"{res.show('export_merged')}: without --use-lora every export is the merged pipeline already; drop it"
        )


RULES = (check_precision, check_lora, check_env_vars, check_ci, check_exports)
