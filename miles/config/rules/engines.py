"""Rollout-engine rules: which backend runs the rollouts, and what the sglang one needs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles.config.resolution import Resolution

if TYPE_CHECKING:
    from miles.config.jobs import JobSpec


def resolve_backend(res: Resolution, job: JobSpec) -> None:
    from miles.rollout.engines.sglang.server import gpus_present, resolve_sglang_python

    python = resolve_sglang_python(res["sglang_python"])
    if res["rollout_backend"] == "auto":
        res.derive("rollout_backend", "sglang" if python is not None and gpus_present() else "diffusers")
    if res["rollout_backend"] != "sglang" or not job.generates:
        return
    if res["sglang_python"] and python is None:
        res.fail(f"{res.show('sglang_python')}: no such file")
    if python is None:
        res.fail(
            f"{res.show('rollout_backend')} needs an sglang environment: build one with "
            "scripts/build_sglang_env.sh, or point --sglang-python (or $MILES_SGLANG_PYTHON) at its python"
        )
    if job.name == "dmd2":
        res.fail(f"{res.show('rollout_backend')}: train dmd2 samples its few-step student on the diffusers backend")
    if not res["use_miles_router"]:
        if res.explicit("use_miles_router"):
            res.fail(f"{res.show('use_miles_router')}: sglang engines are reached through the miles router")
        res.derive("use_miles_router", True)
    if not gpus_present():
        _check_family_serves_on_cpu(res)
    _check_family_settings_on_sglang(res)
    if res["offload_rollout"] and not gpus_present():
        why = (
            "sglang releases an engine's GPU memory through /release_memory_occupation, which needs CUDA (a CPU "
            "server answers 'Found no NVIDIA driver') and this machine has no GPU"
        )
        for dest in ("offload", "offload_rollout"):
            if res.explicit(dest) and res[dest]:
                res.fail(f"{res.show(dest)}: {why}")
        res.derive("offload_rollout", False)
        res.warn(f"--offload-rollout is off: {why}; the sglang engines keep their (CPU) weights between phases")


def _check_family_serves_on_cpu(res: Resolution) -> None:
    """A family whose sglang pipeline needs kernels its CPU build lacks is refused on a machine without GPUs."""
    from miles.config.errors import ConfigError
    from miles.models.families import resolve_family

    if res["train_pipeline_config_path"] is not None:
        return
    try:
        family = resolve_family(res["hf_checkpoint"], family=res["diffusion_model_family"], require_trainable=False)
    except ConfigError:
        return  # the model rules name the problem
    if family.sglang_cpu_blocker:
        res.fail(
            f"{res.show('rollout_backend')}: sglang cannot serve model family {family.name!r} on this machine without "
            f"a GPU ({family.sglang_cpu_blocker}); use --rollout-backend diffusers here"
        )


def _check_family_settings_on_sglang(res: Resolution) -> None:
    """Settings under which sglang would sample something other than the family's pipeline are refused."""
    from miles.config.errors import ConfigError
    from miles.models.checkpoints import is_builtin_model
    from miles.models.families import resolve_family
    from miles.models.tiny.metadata import TINY_MAX_SEQUENCE_LENGTH, max_sequence_length, read_metadata

    if res["train_pipeline_config_path"] is not None:
        return
    try:
        family = resolve_family(res["hf_checkpoint"], family=res["diffusion_model_family"], require_trainable=False)
    except ConfigError:
        return
    checkpoint = str(res["hf_checkpoint"])
    if is_builtin_model(checkpoint) and read_metadata(checkpoint) is None:
        length = TINY_MAX_SEQUENCE_LENGTH  # not built yet: every built-in tiny model keeps its text this short
    else:
        length = max_sequence_length(checkpoint, default=family.max_sequence_length)
    why = family.sglang_blocker(float(res["diffusion_guidance_scale"]), res["diffusion_true_cfg_scale"], length)
    if why:
        flag = (
            "diffusion_true_cfg_scale" if res["diffusion_true_cfg_scale"] is not None else "diffusion_guidance_scale"
        )
        res.fail(
            f"{res.show('rollout_backend')} with {res.show(flag)}: {why}; "
            "use --rollout-backend diffusers, or no negative branch"
        )


RULES = (resolve_backend,)
