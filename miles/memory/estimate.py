"""The memory plan: each GPU's estimated peak per phase (train / sync / rollout), checked against its capacity.

Peak of a GPU in a phase = its static bytes (`miles.memory.static`: parameters, gradients, AdamW, EMA, teacher,
the engine's pipeline, sync buffers; exact arithmetic) + the largest transient of the slots on it in that phase
(phases run one after the other, so two slots' transients never overlap):
  train    the trainer's micro-batch step, traced on fake tensors (`miles.memory.step`): activations and backward
           temporaries; or AdamW's foreach temporaries (one copy of the trainable shards, a formula) when larger
  rollout  one denoising forward of the engine's microgroup, traced the same way (no gradients)
What is not counted: the CUDA context and workspaces (cuBLAS, NCCL: about 0.5-1.5 GiB), allocator fragmentation,
the VAE decode's and the text encoders' activations, reward models; `MARGIN_GIB` covers the first two.

A plan over capacity is refused with one line (`ConfigError`, exit 2): the peak, the capacity and each change
that brings the peak under it, computed by resolving the job again with that change (`fit_changes`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from miles.memory.static import GIB, ROLLOUT, TRAIN, Entry, GpuStatic, StaticMemory, static_memory

DEFAULT_GPU_MEMORY_GIB = 80.0
MARGIN_GIB = 1.5  # CUDA context, cuBLAS / NCCL workspaces (shared/reference/memory_estimation.md)
GPU_MEMORY_ENV = "MILES_GPU_MEMORY_GIB"


@dataclass
class MemoryEstimate:
    static: StaticMemory
    gpus: list[GpuStatic]  # each GPU's static entries plus its slots' largest transient per phase
    capacity_gib: float
    capacity_source: str
    notes: list[str] = field(default_factory=list)
    traces: list[dict[str, Any]] = field(default_factory=list)

    def peak(self) -> tuple[GpuStatic, str, int]:
        best = None
        for g in self.gpus:
            phase, n = g.peak()
            if best is None or n > best[2]:
                best = (g, phase, n)
        if best is None:
            raise ValueError("the plan has no GPU")
        return best

    def phase_peak(self, phase: str) -> int:
        return max((g.total(phase) for g in self.gpus), default=0)

    def with_margin(self, nbytes: int) -> float:
        return nbytes / GIB + MARGIN_GIB

    def fits(self) -> bool:
        if self.capacity_gib <= 0:
            return True
        return self.with_margin(self.peak()[2]) <= self.capacity_gib

    def to_json(self) -> dict[str, Any]:
        gpu, phase, nbytes = self.peak()
        return {
            "capacity_gib": self.capacity_gib,
            "capacity_source": self.capacity_source,
            "margin_gib": MARGIN_GIB,
            "peak": {"node": gpu.node, "gpu": gpu.gpu, "phase": phase, "gib": round(nbytes / GIB, 3)},
            "fits": self.fits(),
            "model": {
                "checkpoint": self.static.model.checkpoint,
                "parameters": self.static.model.parameters,
                "total_parameters": self.static.model.total,
                "trainable": self.static.model.trainable,
            },
            "traces": self.traces,
            "notes": self.notes,
        }

    def gpu_json(self, node: int, gpu: int) -> dict[str, Any]:
        for g in self.gpus:
            if (g.node, g.gpu) == (node, gpu):
                return {p: dict(v, gib=round(v["bytes"] / GIB, 3)) for p, v in g.to_json()["phases"].items()}
        return {}


# ---- capacity -------------------------------------------------------------------------------------------------
def detected_gpu_memory_gib() -> float | None:
    """The smallest GPU's memory on this machine from nvidia-smi (None: no nvidia-smi, or it failed)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
        values = [float(line) for line in out.split() if line.strip()]
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return min(values) / 1024 if values else None


def capacity(args: Any) -> tuple[float, str]:
    """(GiB per GPU, where it came from): --gpu-memory-gib, $MILES_GPU_MEMORY_GIB, nvidia-smi, else 80."""
    if args.gpu_memory_gib is not None:
        return float(args.gpu_memory_gib), "--gpu-memory-gib"
    if os.environ.get(GPU_MEMORY_ENV):
        return float(os.environ[GPU_MEMORY_ENV]), f"${GPU_MEMORY_ENV}"
    detected = detected_gpu_memory_gib()
    if detected is not None:
        return round(detected, 2), "nvidia-smi"
    return DEFAULT_GPU_MEMORY_GIB, "default (no GPU here)"


# ---- the estimate ---------------------------------------------------------------------------------------------
def _transients(resolved: Any, plan: Any, static: StaticMemory, notes: list[str], traces: list[dict]) -> dict:
    """{slot label: {phase: Entry}} of each slot's traced transient."""
    from miles.memory.config_dirs import config_dir_for
    from miles.memory.counts import DTYPE_BYTES
    from miles.memory.static import denoiser_of, shard_group_size
    from miles.memory.step import read_configs, rollout_spec, trace, train_spec
    from miles.models.families import args_family
    from miles.models.pipeline_config import target_components

    out: dict[str, dict[str, Entry]] = {}

    def traced(config_dir: Any, family: Any, spec: Any, what: str) -> dict[str, Any] | None:
        try:
            result = trace(config_dir, family, spec)
        except NotImplementedError as exc:
            notes.append(f"{what}: activations not estimated ({exc})")
            return None
        traces.append({"what": what, "spec": spec.describe(), "gib": round(result["transient_peak"] / GIB, 3)})
        return result

    engines = plan.slots_of("engine")
    for role, role_args in resolved.trainer_args.items():
        family = args_family(role_args)
        config_dir = config_dir_for(str(role_args.hf_checkpoint), family)
        if config_dir is None:
            continue
        components = family.denoiser_components(target_components(role_args.update_weight_target_module))
        configs = read_configs(config_dir)
        try:
            spec = train_spec(role_args, family, configs, components)
        except NotImplementedError as exc:
            notes.append(f"{role} step: activations not estimated ({exc})")
            continue
        result = traced(config_dir, family, spec, f"{role} step")
        if result is None:
            continue
        activations = Entry("activations", result["transient_peak"], f"traced: {spec.describe()}")
        # AdamW's foreach step keeps temporaries of the trainable shards' size (after the backward has freed the
        # activations: the two never add up)
        from miles.memory.cache import model_counts

        counts = model_counts(config_dir, family, components, [spec.lora[2]] if spec.lora else [])
        denoiser, _ = denoiser_of(counts, family, role_args)
        shards = shard_group_size(role_args)
        trainable = sum(n for n, _ in denoiser.trainable_shard_elements(shards, bool(role_args.use_lora)))
        foreach = 0 if role_args.fsdp_cpu_offload else trainable * DTYPE_BYTES["float32"]
        transient = activations
        if foreach > activations.bytes:
            transient = Entry("adam/foreach", foreach, "formula: AdamW foreach temporaries (one fp32 trainable shard)")
        for slot in plan.slots_of(role):
            out.setdefault(slot.label, {})[TRAIN] = Entry(transient.name, transient.bytes, transient.note, slot.label)
        if role == "actor" and engines:
            rspec = rollout_spec(resolved.args, family, configs, components)
            rolled = traced(config_dir, family, rspec, "engine forward")
            if rolled is not None:
                for slot in engines:
                    out.setdefault(slot.label, {})[ROLLOUT] = Entry(
                        "denoise activations", rolled["transient_peak"], f"traced: {rspec.describe()}", slot.label
                    )
    return out


def gpu_view(resolved: Any) -> tuple[Any, str | None]:
    """`resolved` as a GPU cluster would run it: on a machine without GPUs `--rollout-backend auto` resolves to the
    in-process diffusers engine, where a GPU cluster with an sglang environment serves the family with sglang
    (`miles.config.rules.engines.resolve_backend`); the plan estimates the GPU run. (None: no change.)"""
    import dataclasses

    from miles.models.families import args_family
    from miles.utils.sglang_env import gpus_present

    args = resolved.args
    if (
        args.rollout_backend != "diffusers"
        or args.source_of("rollout_backend") != "derived"
        or not resolved.spec.generates
        or resolved.spec.distills  # its few-step student samples on the diffusers backend only
        or gpus_present()
    ):
        return resolved, None
    try:
        family = args_family(args)
    except Exception:  # a family problem: the config rules name it
        return resolved, None
    if family.sglang_unserved:
        return resolved, None
    view = dataclasses.replace(
        resolved,
        args=args.with_values({"rollout_backend": "sglang"}, "derived"),
        trainer_args={
            role: a.with_values({"rollout_backend": "sglang"}, "derived") if "rollout_backend" in a else a
            for role, a in resolved.trainer_args.items()
        },
    )
    return view, "engines as a GPU cluster runs them (--rollout-backend auto: sglang); here they would be diffusers"


def estimate_memory(resolved: Any, plan: Any = None) -> MemoryEstimate:
    """The memory plan of `resolved` on `plan` (default: the plan on the cluster the flags describe), for a GPU
    cluster (`gpu_view`)."""
    resolved, view_note = gpu_view(resolved)
    if plan is None:
        from miles.placement.cluster import flags_cluster
        from miles.placement.plan import make_plan

        plan = make_plan(resolved.args, flags_cluster(resolved.args), resolved.spec)
    static = static_memory(resolved, plan)
    notes = ([view_note] if view_note else []) + list(static.notes)
    traces: list[dict[str, Any]] = []
    transients = _transients(resolved, plan, static, notes, traces)
    gpus = []
    for g in static.gpus:
        phases = {p: list(es) for p, es in g.phases.items()}
        for phase in phases:
            candidates = [transients.get(label, {}).get(phase) for label in g.slots]
            present = [c for c in candidates if c is not None]
            if present:
                phases[phase].append(max(present, key=lambda e: e.bytes))
        gpus.append(GpuStatic(g.node, g.gpu, list(g.slots), phases))
    cap, source = capacity(resolved.args)
    notes.append(
        f"not counted: the CUDA context and workspaces (a {MARGIN_GIB} GiB margin is added), fragmentation, "
        "the VAE decode and text encoders' activations"
    )
    return MemoryEstimate(static, gpus, cap, source, notes, traces)


# ---- what makes it fit ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Change:
    flags: str  # as the user types it
    cli: Mapping[str, Any]  # dest -> value, merged into the command line


def candidate_changes(resolved: Any) -> list[Change]:
    """The changes worth computing, cheapest first: each leaves the method and the model as they are."""
    from miles.memory.step import micro_batch_rows

    args = resolved.args
    trainers = list(resolved.trainer_args.values())
    engines = any(s.role == "engine" for s in _plan_slots(resolved))
    out: list[Change] = []
    if not all(a.gradient_checkpointing for a in trainers):
        out.append(Change("--gradient-checkpointing", {"gradient_checkpointing": True}))
    if any(micro_batch_rows(a) > 1 for a in trainers):
        out.append(Change("--micro-batch-size 1", {"micro_batch_size": 1}))
    if int(args.rollout_microgroup_size or 1) > 1 and engines:
        out.append(Change("--rollout-microgroup-size 1", {"rollout_microgroup_size": 1}))
    if not args.use_lora and not resolved.spec.distills:
        out.append(Change("--use-lora", {"use_lora": True}))
    if not (args.offload_train and args.offload_rollout) and engines:
        out.append(Change("--offload", {"offload": True}))
    nodes = int(args.actor_num_nodes)
    out.append(Change(f"--actor-num-nodes {nodes * 2}", {"actor_num_nodes": nodes * 2}))
    if not args.fsdp_cpu_offload:
        out.append(Change("--fsdp-cpu-offload", {"fsdp_cpu_offload": True}))
    return out


def _plan_slots(resolved: Any) -> list[Any]:
    from miles.placement.cluster import flags_cluster
    from miles.placement.plan import make_plan

    try:
        return list(make_plan(resolved.args, flags_cluster(resolved.args), resolved.spec).slots)
    except Exception:
        return []


def fit_changes(
    estimate: MemoryEstimate,
    reresolve: Callable[[Mapping[str, Any]], Any],
    candidates: Sequence[Change],
    make_plan_for: Callable[[Any], Any],
) -> list[tuple[str, float, bool]]:
    """(flags, peak GiB with the margin, fits) of each candidate that lowers the peak, in candidate order."""
    from miles.core.errors import ConfigError

    def peak_with(cli: Mapping[str, Any]) -> float | None:
        try:
            resolved = reresolve(cli)
            return estimate.with_margin(estimate_memory(resolved, make_plan_for(resolved)).peak()[2])
        except (ConfigError, LookupError, NotImplementedError):
            return None

    base = estimate.with_margin(estimate.peak()[2])
    out: list[tuple[str, float, bool]] = []
    for change in candidates:
        gib = peak_with(change.cli)
        if gib is not None and gib < base - 0.005:
            out.append((change.flags, gib, gib <= estimate.capacity_gib))
    return out


def refusal(estimate: MemoryEstimate, changes: Sequence[tuple[str, float, bool]] | None) -> str:
    """The one line of a plan over capacity; `changes` (from `fit_changes`; None: not computed) are named in it."""
    gpu, phase, nbytes = estimate.peak()
    line = (
        f"the memory plan does not fit: node {gpu.node} GPU {gpu.gpu} peaks at {estimate.with_margin(nbytes):.1f} GiB "
        f"in the {phase} phase, over the {estimate.capacity_gib:g} GiB per GPU of {estimate.capacity_source}"
    )
    if changes is None:
        return line
    fitting = [c for c in changes if c[2]]
    shown = fitting or list(changes)
    if shown:
        verb = "fits with" if fitting else "still over with"
        line += f"; {verb}: " + ", ".join(f"{flags} -> {gib:.1f} GiB" for flags, gib, _ in shown)
    else:
        line += "; no single change computed here brings it down (see `miles plan`'s breakdown)"
    return line
