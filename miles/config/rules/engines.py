"""Rollout-engine rules: which backend runs the rollouts, and what the sglang one needs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles.config.args import RECIPE
from miles.config.resolution import Resolution

if TYPE_CHECKING:
    from miles.config.jobs import JobSpec
    from miles.models.pipeline_config import TrainPipelineConfig


def resolve_backend(res: Resolution, job: JobSpec) -> None:
    from miles.utils.sglang_env import gpus_present, resolve_sglang_python

    python = resolve_sglang_python(res["sglang_python"])
    unserved = _family_sglang_unserved(res)
    if res["rollout_backend"] == "auto":
        serves = python is not None and gpus_present() and not unserved
        res.derive("rollout_backend", "sglang" if serves else "diffusers")
    if res["rollout_backend"] != "sglang" or not job.generates:
        return
    if unserved:
        name, why = unserved
        res.fail(
            f"{res.show('rollout_backend')}: sglang cannot serve model family {name!r} ({why}); "
            "use --rollout-backend diffusers"
        )
    if res["sglang_python"] and python is None:
        res.fail(f"{res.show('sglang_python')}: no such file")
    if python is None:
        res.fail(
            f"{res.show('rollout_backend')} needs an sglang environment: build one with "
            "scripts/build_sglang_env.sh, or point --sglang-python (or $MILES_SGLANG_PYTHON) at its python"
        )
    if job.distills:
        res.fail(f"{res.show('rollout_backend')}: {job.command} samples its few-step student on the diffusers backend")
    for dest in ("diffusion_shared_prefix", "diffusion_post_sde_steps_ratio"):
        if res[dest] not in (None, False):
            res.fail(
                f"{res.show(dest)} with {res.show('rollout_backend')}: the sglang server samples each output from "
                "its own seed on its own schedule; use --rollout-backend diffusers"
            )
    if res["rollout_engine_batch_size"] is not None:  # how the in-process engine batches its forwards
        if res.source("rollout_engine_batch_size") == RECIPE:  # a CPU recipe's setting: not this backend's
            res.derive("rollout_engine_batch_size", None)
        else:
            res.fail(
                f"{res.show('rollout_engine_batch_size')} with {res.show('rollout_backend')}: the sglang server "
                "batches the requests it is sent itself; use --rollout-backend diffusers"
            )
    if res["diffusion_ode_solver"] != "euler":
        res.fail(
            f"{res.show('diffusion_ode_solver')} with {res.show('rollout_backend')}: the sglang server's "
            "deterministic steps are its scheduler's; use --rollout-backend diffusers"
        )
    if res["diffusion_grpo_guard"]:
        res.fail(
            f"{res.show('diffusion_grpo_guard')} with {res.show('rollout_backend')}: GRPO-Guard compares the "
            "trainer's step means with the engine's, which the sglang server does not return; use --rollout-backend "
            "diffusers"
        )
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


def _family_or_none(res: Resolution) -> TrainPipelineConfig | None:
    """The registered model family the resolved flags select, or None: a user's `--train-pipeline-config-path`
    (imported by the runtime, not here), or no family resolves (the model rules name that problem)."""
    from miles.core.errors import ConfigError
    from miles.models.families import resolve_family

    if res["train_pipeline_config_path"] is not None:
        return None
    try:
        return resolve_family(res["hf_checkpoint"], family=res["diffusion_model_family"], require_trainable=False)
    except ConfigError:
        return None


def _family_sglang_unserved(res: Resolution) -> tuple[str, str] | None:
    """(family, why) when the resolved family cannot be served by sglang at all (`sglang_unserved`), else None."""
    family = _family_or_none(res) if res["hf_checkpoint"] is not None else None
    if family is None:
        return None
    return (family.name, family.sglang_unserved) if family.sglang_unserved else None


def _check_family_serves_on_cpu(res: Resolution) -> None:
    """A family whose sglang pipeline needs kernels its CPU build lacks is refused on a machine without GPUs."""
    family = _family_or_none(res)
    if family is not None and family.sglang_cpu_blocker:
        res.fail(
            f"{res.show('rollout_backend')}: sglang cannot serve model family {family.name!r} on this machine without "
            f"a GPU ({family.sglang_cpu_blocker}); use --rollout-backend diffusers here"
        )


def _check_family_settings_on_sglang(res: Resolution) -> None:
    """Settings under which sglang would sample something other than the family's pipeline are refused."""
    from miles.models.tiny.metadata import TINY_MAX_SEQUENCE_LENGTH, max_sequence_length, read_metadata

    family = _family_or_none(res)
    if family is None:
        return
    built_in = res["inputs"].get(str(res["hf_checkpoint"]))  # where a built-in model lives (`inputs`)
    if built_in is not None and read_metadata(built_in) is None:
        length = TINY_MAX_SEQUENCE_LENGTH  # not built yet: every built-in tiny model keeps its text this short
    else:
        length = max_sequence_length(built_in or res["hf_checkpoint"], default=family.max_sequence_length)
    why = family.sglang_blocker(float(res["diffusion_guidance_scale"]), res["diffusion_true_cfg_scale"], length)
    if why:
        flag = (
            "diffusion_true_cfg_scale" if res["diffusion_true_cfg_scale"] is not None else "diffusion_guidance_scale"
        )
        res.fail(
            f"{res.show('rollout_backend')} with {res.show(flag)}: {why}; "
            "use --rollout-backend diffusers, or no negative branch"
        )
    allowed = family.sglang_dit_precisions
    if allowed and res["diffusion_forward_dtype"] not in allowed:
        res.fail(
            f"{res.show('rollout_backend')} with {res.show('diffusion_forward_dtype')}: sglang serves model family "
            f"{family.name!r} at {'/'.join(allowed)} only ({family.sglang_precision_reason}); use "
            f"--diffusion-forward-dtype {allowed[0]}, or --rollout-backend diffusers"
        )


def _samples(res: Resolution, job: JobSpec) -> bool:
    """Whether the job runs rollout engines: it generates, or evaluates eval sets (`miles eval`, or a training job
    with eval data: `miles.config.eval_schedule`)."""
    from miles.config.eval_schedule import evaluates

    return job.generates or evaluates(res, job.name)


def resolve_generator_device(res: Resolution, job: JobSpec) -> None:
    """--diffusion-generator-device is cpu, cuda or cuda:N. Its default (cuda, as in the reference) becomes cpu
    on a machine without GPUs, where no engine can hold a CUDA generator (sglang's CPU build draws on the CPU
    whatever the request says); an explicit cuda there is refused for a job that runs engines."""
    from miles.utils.sglang_env import gpus_present

    dest = "diffusion_generator_device"
    value = str(res[dest]).strip()
    kind, _, index = value.partition(":")
    if kind not in ("cpu", "cuda") or (index and (kind == "cpu" or not index.isdigit())):
        res.fail(f"{res.show(dest)}: expected cpu, cuda or cuda:N")
    if kind != "cuda" or gpus_present():
        return
    if not res.explicit(dest):
        res.derive(dest, "cpu")
    elif _samples(res, job):
        res.fail(
            f"{res.show(dest)}: a CUDA noise generator needs CUDA and this machine has no GPU; "
            "use --diffusion-generator-device cpu"
        )


def check_distributed_post(res: Resolution, job: JobSpec) -> None:
    """--use-distributed-post moves the HTTP POSTs to sglang engines into per-node Ray actors
    ($MILES_HTTP_POST_ACTORS_PER_NODE each): it needs engines reached over HTTP."""
    import os

    from miles.utils.sglang_env import actors_per_node

    dest = "use_distributed_post"
    if not res[dest]:
        return
    if not _samples(res, job):
        res.fail(f"{res.show(dest)}: `miles {job.command}` runs no rollout engines, so nothing is posted")
    if res["rollout_backend"] != "sglang":
        res.fail(
            f"{res.show(dest)} applies to sglang engines only (their POSTs go through per-node Ray actors); "
            f"{res.show('rollout_backend')} samples in-process, with no HTTP"
        )
    try:
        actors_per_node(os.environ)
    except ValueError as exc:
        res.fail(f"{res.show(dest)}: {exc}")


def check_weight_buffer(res: Resolution, job: JobSpec) -> None:
    """--update-weight-buffer-size sizes the chunks of a weight sync: by-handle buckets under --colocate, the
    shards an sglang engine loads from disk, the object-store chunks of the diffusers engines. LoRA on sglang
    engines without --colocate is one adapter file per module through /v1/set_lora: no chunks to size."""
    dest = "update_weight_buffer_size"
    if not res.explicit(dest) or not job.trains or res["rollout_backend"] != "sglang":
        return
    if res["use_lora"] and not res["colocate"]:
        res.fail(
            f"{res.show(dest)}: with {res.show('use_lora')} on sglang engines without --colocate a sync is one "
            "LoRA adapter file per module (/v1/set_lora), which has no chunks to size"
        )


# the reference's engine-side parity patches, by group: what each one aligns with the trainer's diffusers forward
PATCH_GROUPS = {
    "sgld": "sglang's RMSNorm / LayerNormScaleShift ops replaced by diffusers-equivalent arithmetic (Qwen-Image)",
    "wan": "sglang's Wan norms and scale_shift_table arithmetic (with --sglang-attention-backend torch_sdpa)",
    "ltx": "sglang's LTX-2 rollout conditioning kwargs and audio-video cross attention",
}


def check_patch_groups(res: Resolution, job: JobSpec) -> None:
    """--rollout-patch-group: a group the model family honours (`TrainPipelineConfig.patch_groups`, e.g. ltx's
    `ltx`: audio<->video cross attention off) changes the engine's and the trainer's forward alike, on the
    in-process engine. Every other value is refused with the reason: the in-process engine runs the trainer's
    own diffusers forward (nothing to align: model_output diff 0.0), and miles ships none of the reference's
    monkey patches of sglang's ops; on sglang the drift they would remove is what
    --debug-skip-optimizer-step --diffusion-debug-mode measures."""
    dest = "rollout_patch_group"
    groups = [str(g).strip() for g in (res[dest] or []) if str(g).strip()]
    honoured = _family_patch_groups(res)
    groups = [g for g in groups if g not in honoured]
    if not groups:
        return
    if res["rollout_backend"] != "sglang":
        res.fail(
            f"{res.show(dest)}: patch groups align sglang engine ops with the trainer; the in-process engine "
            f"({res.show('rollout_backend')}) runs the trainer's own forward, so there is nothing to patch"
        )
    shown = "; ".join(f"{g}: {PATCH_GROUPS.get(g, 'unknown group')}" for g in groups)
    res.fail(
        f"{res.show(dest)}: miles applies no engine-side parity patches to sglang ({shown}); measure the "
        "train/rollout drift with --debug-skip-optimizer-step --diffusion-debug-mode instead"
    )


def _family_patch_groups(res: Resolution) -> dict[str, str]:
    """The patch groups the resolved model family honours (none when it cannot be resolved here)."""
    family = _family_or_none(res) if res["hf_checkpoint"] is not None else None
    return {} if family is None else dict(family.patch_groups)


RULES = (resolve_backend, resolve_generator_device, check_distributed_post, check_weight_buffer, check_patch_groups)
