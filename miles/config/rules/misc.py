"""Precision, LoRA and environment rules."""

from __future__ import annotations

from typing import TYPE_CHECKING

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


RULES = (check_precision, check_lora, check_env_vars)
