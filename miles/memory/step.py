"""The transient bytes of one DiT forward of a job (activations and temporaries), traced once and cached.

A `StepSpec` is everything the trace depends on (the checkpoint's configs, the module, the micro-batch's shapes,
dtypes, LoRA, gradient checkpointing, CFG, whether it trains): the trainer's step (`grad`: forward, loss, backward
of one micro-batch) or the engine's denoising forward (no grad). `transient_bytes(...)` answers from the
`traces.json` shipped next to a family's real configs, else `$MILES_HOME/memory/traces/<key>.json`, else traces it
(`miles.memory.activations`: fake tensors, seconds at real size) and writes the cache. Torch-free on a hit.

Whether a method's trained forward is guided (the rollout's CFG pairs in the graph) is the method table's
(`miles.methods`, `guided_forward`).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from miles.memory.config_dirs import config_hash, listed_components
from miles.memory.counts import dtype_name
from miles.memory.step_spec import StepSpec
from miles.utils.paths import file_lock, miles_home

TRACES_FILE = "traces.json"


# ---- versions (torch-free: package metadata) ----------------------------------------------------------------------
def trace_versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for name in ("torch", "diffusers", "transformers", "peft"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = ""
    return out


def read_configs(config_dir: Path) -> dict[str, dict[str, Any]]:
    """{component: its config.json} of every listed component that has one."""
    out = {}
    for name, _, _ in listed_components(config_dir):
        path = config_dir / name / "config.json"
        if path.is_file():
            with open(path) as f:
                out[name] = json.load(f)
    return out


# ---- building the specs of a job ----------------------------------------------------------------------------------
def micro_batch_rows(args: Any) -> int:
    """Train pairs per DiT forward: `--micro-batch-size`, or the 2-D tile's product."""
    sample, tstep = args.micro_batch_size_sample, args.micro_batch_size_tstep
    if sample and tstep:
        return int(sample) * int(tstep)
    return int(args.micro_batch_size or 1)


def text_length(checkpoint: Any, family: Any) -> int:
    from miles.models.tiny.metadata import max_sequence_length

    return max_sequence_length(checkpoint, default=int(family.max_sequence_length))


def _shapes(family: Any, configs: Mapping[str, Any], args: Any, checkpoint: Any) -> tuple[tuple[int, ...], tuple]:
    conds = family.example_conditions(configs, text_length(checkpoint, family))  # NotImplementedError: not described
    pipe = family.config_pipe(configs)
    latent = tuple(
        int(x)
        for x in family.latent_shape(
            pipe,
            int(args.diffusion_height),
            int(args.diffusion_width),
            int(args.diffusion_output_num_frames or 1),
        )
    )
    pipe.name_or_path = str(checkpoint)  # as a loaded pipeline's: where a tiny build's metadata is read
    conds = {**conds, **family.example_media_conditions(latent, pipe)}
    conditions = tuple((n, None if s is None else tuple(int(x) for x in s), d) for n, (s, d) in sorted(conds.items()))
    return latent, conditions


def _timestep(family: Any, components: tuple[str, ...]) -> float:
    """A timestep the trained components denoise (rows go to one expert in a family with experts)."""
    rng = family.trainable_sigma_range(components)
    lo, hi = rng if rng is not None else (0.0, 1.0)
    return round(500.0 * (lo + hi), 3)


def guided(family: Any, args: Any) -> bool:
    return family.cfg_scale(float(args.diffusion_guidance_scale), args.diffusion_true_cfg_scale) > 1.0


def train_spec(role_args: Any, family: Any, configs: Mapping[str, Any], components: tuple[str, ...]) -> StepSpec:
    """The trainer's micro-batch: forward (guided when the method re-scores the rollout's guided velocity and the
    family trains with CFG; the method's `forward_rows` rows per pair), loss, backward."""
    from miles.memory.static import lora_targets

    latent, conditions = _shapes(family, configs, role_args, role_args.hf_checkpoint)
    from miles.methods import METHODS

    known = METHODS.get(str(role_args.loss_type))
    cfg = (known.guided_forward if known is not None else True) and family.supports_cfg_training
    rows = known.forward_rows if known is not None else 1  # e.g. DPO's winner and loser per pair
    lora = None
    if role_args.use_lora:
        lora = (int(role_args.lora_rank), int(role_args.lora_alpha), tuple(lora_targets(role_args, family)))
    return StepSpec(
        family=family.name,
        components=tuple(components),
        batch=micro_batch_rows(role_args) * rows,
        latent=latent,
        conditions=conditions,
        forward_dtype=dtype_name(role_args.diffusion_forward_dtype),
        cfg=bool(cfg and guided(family, role_args)),
        grad=True,
        gradient_checkpointing=bool(role_args.gradient_checkpointing),
        lora=lora,
        timestep=_timestep(family, tuple(components)),
    )


def rollout_spec(args: Any, family: Any, configs: Mapping[str, Any], components: tuple[str, ...]) -> StepSpec:
    """One denoising forward of the engine: a microgroup (`--rollout-microgroup-size` samples), guided when the
    rollout's CFG is on, without gradients."""
    latent, conditions = _shapes(family, configs, args, args.hf_checkpoint)
    return StepSpec(
        family=family.name,
        components=tuple(components),
        batch=max(1, int(args.rollout_microgroup_size or 1)),
        latent=latent,
        conditions=conditions,
        forward_dtype=dtype_name(args.diffusion_forward_dtype),
        cfg=guided(family, args),
        grad=False,
        gradient_checkpointing=False,
        lora=None,
        timestep=_timestep(family, tuple(components)),
    )


# ---- the cache -------------------------------------------------------------------------------------------------
def traces_dir() -> Path:
    return miles_home() / "memory" / "traces"


def _read_json(path: Path) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def cached_trace(config_dir: Path, spec: StepSpec) -> dict[str, Any] | None:
    """The trace of `spec` shipped next to the configs or in the cache (None: not traced yet)."""
    digest = config_hash(config_dir)
    shipped = _read_json(config_dir / TRACES_FILE) or {}
    if spec.key(digest) in shipped:
        return shipped[spec.key(digest)]
    return _read_json(traces_dir() / f"{spec.key(digest, trace_versions())}.json")


RECORDED: list[tuple[Path, Any, StepSpec]] = []  # every (config dir, family, spec) asked for, when recording
_recording = False


def record_traces(on: bool) -> None:
    """Record every spec `trace` is asked for (`miles.memory.shipped` collects the shipped recipes' this way)."""
    global _recording
    _recording = on
    RECORDED.clear()


def trace(config_dir: Path, family: Any, spec: StepSpec) -> dict[str, Any]:
    """The trace of `spec`, from the cache, else traced now and cached."""
    if _recording:
        RECORDED.append((config_dir, family, spec))
    hit = cached_trace(config_dir, spec)
    if hit is not None:
        return hit
    return trace_now(config_dir, family, spec)


def trace_now(config_dir: Path, family: Any, spec: StepSpec) -> dict[str, Any]:
    """Trace `spec` with the installed libraries (or read the user's cache of that) and cache it."""
    key = spec.key(config_hash(config_dir), trace_versions())
    path = traces_dir() / f"{key}.json"
    with file_lock(traces_dir() / f".{key}.lock"):
        hit = _read_json(path)
        if hit is not None:
            return hit
        from miles.memory.activations import trace_step

        result = trace_step(config_dir, family, spec)
        result["spec"] = spec.to_json()
        result["versions"] = trace_versions()
        _write_json(path, result)
    return result


def write_shipped_traces(config_dir: Path, family: Any, specs: list[StepSpec]) -> Path:
    """Trace `specs` (the shipped recipes' steps) and write them to `<config_dir>/traces.json`."""
    digest, versions = config_hash(config_dir), trace_versions()
    out: dict[str, Any] = {}
    for spec in specs:
        key = spec.key(digest)
        if key not in out:
            out[key] = _read_json(traces_dir() / f"{spec.key(digest, versions)}.json") or trace_now(
                config_dir, family, spec
            )
    _write_json(config_dir / TRACES_FILE, out)
    return config_dir / TRACES_FILE
