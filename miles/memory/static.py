"""The static bytes of a job on each GPU of its plan, per phase (train / sync / rollout): plain arithmetic on the
measured tensor counts (`counts`), torch-free and instant.

What each trainer rank holds (`miles.training.trainer.Trainer`, `miles.training.model.shard`):
  params       the denoiser loaded in `--fsdp-master-dtype` (its library's fp32 pins kept), FSDP2-sharded over
               world / `--dp-replicate-size` ranks: rank 0's chunk of dim 0 of each parameter, which is also the
               padded shard every rank allocates; LoRA adapters take their base weight's dtype
  buffers      not sharded: every rank holds them in full
  grads        the trainable shards, in the parameters' dtype (FSDP2 casts the reduced gradient back)
  adam         `torch.optim.AdamW`: exp_avg and exp_avg_sq like each trainable shard (its dtype: bf16 under
               `--fsdp-master-dtype bf16`); its `step` counters live on the CPU
  ema          `--use-ema`: an fp32 copy of the trainable shards (`EmaShadow`); `--ref-mode ema` and
               `--ema-rollout-policy ema` swap it in with a clone of the live shards as the backup
  teacher      DMD2's critic (`--loss-type dmd2_critic`) with full weights: a second, frozen, sharded copy of the
               denoiser (with a LoRA critic the teacher is its own base: nothing more); `--offload-train` does not
               move it, so it stays in every phase
  ref/frozen   `--ref-mode frozen`: a frozen copy of the start weights (adapters included), sharded like the params,
               with its buffers (`ref/frozen_buffers`); `--offload-train` moves it with the params
Under `--fsdp-cpu-offload` params, grads, adam and ema are on the host. Between phases `--offload-train` moves
optimizer state and gradients off after train, parameters (and the EMA) after the sync (`miles.runtime.phases`).
Under a LoRA-only sync (`miles.models.lora_sync.lora_only_sync`) it moves before the sync also all the sync does
not read: the frozen base's shards, the buffers, the frozen reference and the EMA unless it is served
(`--ema-rollout-policy ema`); the sync phase holds the adapters' shards ("params") and what the sync itself needs.

What each engine holds (`DiffusersEngine`): every module of the pipeline in `--diffusion-forward-dtype` (the VAE
in fp32 when that is not fp32), released under `--offload-rollout` while the trainers train. With LoRA-only weight
sync the diffusers engine also keeps a copy of each adapted base weight (`LoraMerger`): in pinned host memory next
to GPU weights, so not counted here (a note gives its size); only the module being merged has its base on the GPU.

The weight sync (`miles.training.in_place_sync`; the actor's weights only): every rank gathers each tensor to its
full size on the device before copying it to the host (`sync/gather`: the largest tensor), and under `--colocate`
each feeding rank packs one bucket of at most `--update-weight-buffer-size` bytes on its device (`sync/bucket`).

Notes per entry: "exact" is arithmetic on exact shapes and dtypes; "bound" an upper bound; "formula" an
approximation of a transient (activations are not estimated here).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles.memory.counts import (
    BUFFER,
    DTYPE_BYTES,
    LOCAL_BUFFER,
    PARAM,
    AdapterGroup,
    ModelCounts,
    TensorGroup,
    dtype_name,
)
from miles.methods import METHODS
from miles.models.lora_sync import lora_only_sync

TRAIN, SYNC, ROLLOUT = "train", "sync", "rollout"
LORA_BASE_COPIES = "lora_merger/base_copies"  # named in a note: host memory, not counted on the GPU
PHASES = (TRAIN, SYNC, ROLLOUT)
EXACT = "exact"
GIB = 1024**3


@dataclass(frozen=True)
class Entry:
    """`bytes` of one thing on one GPU in one phase; `owner` is the slot holding it (e.g. `actor 0`)."""

    name: str
    bytes: int
    note: str = EXACT
    owner: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "bytes": self.bytes, "gib": round(self.bytes / GIB, 3), "note": self.note}


@dataclass
class SlotStatic:
    """One trainer rank or engine: its entries per phase."""

    label: str
    phases: dict[str, list[Entry]] = field(default_factory=dict)

    def add(self, phases: Iterable[str], name: str, nbytes: int, note: str = EXACT) -> None:
        for phase in phases:
            self.phases.setdefault(phase, []).append(Entry(name, int(nbytes), note, self.label))


@dataclass
class GpuStatic:
    node: int
    gpu: int
    slots: list[str]
    phases: dict[str, list[Entry]]

    def total(self, phase: str) -> int:
        return sum(e.bytes for e in self.phases.get(phase, []))

    def peak(self) -> tuple[str, int]:
        """The phase with the most bytes, and that number."""
        return max(((p, self.total(p)) for p in self.phases), key=lambda kv: kv[1], default=(TRAIN, 0))

    def largest(self, phase: str, n: int = 3) -> list[Entry]:
        return sorted(self.phases.get(phase, []), key=lambda e: -e.bytes)[:n]

    def to_json(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "gpu": self.gpu,
            "slots": self.slots,
            "phases": {
                p: {"bytes": self.total(p), "entries": [dict(e.to_json(), owner=e.owner) for e in es]}
                for p, es in self.phases.items()
            },
        }


@dataclass
class ModelSummary:
    checkpoint: str
    config_dir: str
    parameters: dict[str, int]  # component -> parameters
    trainable: dict[str, int]  # trainer role -> trainable parameters

    @property
    def total(self) -> int:
        return sum(self.parameters.values())


@dataclass
class StaticMemory:
    model: ModelSummary
    gpus: list[GpuStatic]
    notes: list[str] = field(default_factory=list)

    def peak(self, phase: str | None = None) -> tuple[GpuStatic, str, int]:
        """The GPU with the most static bytes (in `phase`, or in its own worst phase)."""
        best: tuple[GpuStatic, str, int] | None = None
        for gpu in self.gpus:
            p, n = (phase, gpu.total(phase)) if phase else gpu.peak()
            if best is None or n > best[2]:
                best = (gpu, p, n)
        if best is None:
            raise ValueError("the plan has no GPU")
        return best

    def to_json(self) -> dict[str, Any]:
        return {
            "checkpoint": self.model.checkpoint,
            "config_dir": self.model.config_dir,
            "parameters": self.model.parameters,
            "total_parameters": self.model.total,
            "trainable": self.model.trainable,
            "gpus": [g.to_json() for g in self.gpus],
            "notes": self.notes,
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2)


# ---- the denoiser of one trainer role ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Denoiser:
    """The trainer's module: its components' tensors and (under LoRA) its adapters, as loaded in `master`."""

    tensors: tuple[tuple[str, TensorGroup], ...]  # (library, group)
    adapters: tuple[AdapterGroup, ...]
    rank: int
    master: str

    def _dtype(self, library: str, group: TensorGroup) -> int:
        return DTYPE_BYTES[group.dtype_at(library, self.master)]

    def _adapter_bytes(self, a: AdapterGroup) -> int:
        pinned = TensorGroup(1, 1, 1, PARAM, "", a.pin).pinned(self.master)
        return DTYPE_BYTES["float32" if pinned else self.master]

    def params(self) -> int:
        return sum(g.numel for _, g in self.tensors if g.kind == PARAM)

    def trainable(self, lora: bool) -> int:
        return sum(a.numel(self.rank) for a in self.adapters) if lora else self.params()

    def sharded_bytes(self, shards: int, which: str) -> int:
        """Rank 0's bytes of the FSDP2 shards of `which`: "base" (every parameter of the loaded model), "adapters",
        or "buffers" (not sharded)."""
        if which == "buffers":
            return sum(g.numel * self._dtype(lib, g) for lib, g in self.tensors if g.kind in (BUFFER, LOCAL_BUFFER))
        if which == "adapters":
            return sum(a.shard_size(self.rank, shards) * self._adapter_bytes(a) for a in self.adapters)
        return sum(g.shard_size(shards) * g.count * self._dtype(lib, g) for lib, g in self.tensors if g.kind == PARAM)

    def trainable_shard_elements(self, shards: int, lora: bool) -> list[tuple[int, int]]:
        """(elements of rank 0's trainable shards, bytes per element) per dtype class."""
        if lora:
            return [(a.shard_size(self.rank, shards), self._adapter_bytes(a)) for a in self.adapters]
        return [(g.shard_size(shards) * g.count, self._dtype(lib, g)) for lib, g in self.tensors if g.kind == PARAM]

    def largest_tensor(self, lora_only: bool) -> int:
        """Bytes of the largest single tensor (the sync gathers one tensor at a time to its full size)."""
        if lora_only:
            return max(
                (t.size * self._adapter_bytes(a) for a in self.adapters for t in a.tensors(self.rank)), default=0
            )
        return max((g.size * self._dtype(lib, g) for lib, g in self.tensors if g.kind in (PARAM, BUFFER)), default=0)

    def sync_payload_groups(self, lora_only: bool) -> dict[str, int]:
        """{dtype: bytes} of what one sync pushes: the LoRA tensors (A, B, and an fp64 scaling per module), or the
        full state dict (LoRA merged)."""
        out: dict[str, int] = {}
        if lora_only:
            for a in self.adapters:
                width = self._adapter_bytes(a)
                dtype = "float32" if width == 4 else self.master
                out[dtype] = out.get(dtype, 0) + a.numel(self.rank) * width
                out["float64"] = out.get("float64", 0) + a.count * 8
            return out
        for lib, g in self.tensors:
            if g.kind in (PARAM, BUFFER):
                dtype = g.dtype_at(lib, self.master)
                out[dtype] = out.get(dtype, 0) + g.numel * DTYPE_BYTES[dtype]
        return out

    def largest_sync_unit(self, lora_only: bool) -> int:
        """The largest piece a bucket cannot split: a LoRA module's A and B, or one tensor."""
        if lora_only:
            return max((a.numel(self.rank) // a.count * self._adapter_bytes(a) for a in self.adapters), default=0)
        return self.largest_tensor(False)

    def _adapted_bases(self, library_of: Mapping[str, str], forward: str) -> list[tuple[TensorGroup, int]]:
        """(the base weights of each adapter group, their bytes per element in the engine's `forward` dtype)."""
        out = []
        for a in self.adapters:
            group = TensorGroup(a.b_rows, a.a_rest * a.b_rest, a.count, PARAM, "", a.pin)
            out.append((group, DTYPE_BYTES[group.dtype_at(library_of.get(a.component, "diffusers"), forward)]))
        return out

    def adapted_base_bytes(self, library_of: Mapping[str, str], forward: str) -> int:
        """Bytes of the base weights the adapters sit on, in the engine's `forward` dtype (pins kept)."""
        return sum(group.numel * width for group, width in self._adapted_bases(library_of, forward))

    def merge_bytes(self, library_of: Mapping[str, str], forward: str) -> int:
        """The engine's merge of its largest adapted weight (`LoraMerger.apply`): its base brought to the device, in
        the engine's dtype, and the fp32 math of `merge_lora_weight` (the base, B @ A and its scaled copy at once)."""
        bases = self._adapted_bases(library_of, forward)
        return max((group.size * (width + 3 * DTYPE_BYTES["float32"]) for group, width in bases), default=0)


def denoiser_of(counts: ModelCounts, family: Any, args: Any) -> tuple[Denoiser, tuple[str, ...]]:
    from miles.models.pipeline_config import target_components

    components = family.denoiser_components(target_components(args.update_weight_target_module))
    tensors = tuple((counts.components[c].library, g) for c in components for g in counts.components[c].tensors)
    adapters: tuple[AdapterGroup, ...] = ()
    if args.use_lora:
        adapters = counts.adapters(components, lora_targets(args, family))
    return Denoiser(tensors, adapters, int(args.lora_rank), dtype_name(args.fsdp_master_dtype)), components


def lora_targets(args: Any, family: Any) -> tuple[str, ...]:
    return tuple(args.lora_target_modules or family.lora_target_modules)


# ---- a trainer rank ---------------------------------------------------------------------------------------------
def shard_group_size(args: Any) -> int:
    """FSDP2 shards over world / `--dp-replicate-size` ranks (`miles.training.parallel`)."""
    world = int(args.actor_num_nodes) * int(args.actor_num_gpus_per_node)
    return max(1, world // max(1, int(args.dp_replicate_size or 1)))


def trainer_slot(
    label: str,
    args: Any,
    denoiser: Denoiser,
    counts: ModelCounts,
    family: Any,
    components: tuple[str, ...],
    phases: tuple[str, ...],
    feeds_engine: bool,
    config: Mapping[str, Any],
    syncs: bool = True,
) -> SlotStatic:
    slot = SlotStatic(label)
    shards = shard_group_size(args)
    lora = bool(args.use_lora)
    offload = bool(args.offload_train)
    host = bool(args.fsdp_cpu_offload)
    lora_only = lora_only_sync(args)
    on = [p for p in phases if not (offload and p == ROLLOUT)]  # where parameters are on the device
    optimizer_on = [p for p in phases if p == TRAIN or not offload]
    # where all of the model is on the device: before a LoRA-only sync the trainer drops what it does not read
    whole = [p for p in on if not (offload and lora_only and p == SYNC)]
    adapters_only = [p for p in on if p not in whole]
    where = "on the host (--fsdp-cpu-offload)" if host else EXACT

    def gpu(nbytes: int) -> int:
        return 0 if host else nbytes

    adapters = denoiser.sharded_bytes(shards, "adapters") if lora else 0
    params = denoiser.sharded_bytes(shards, "base") + adapters
    slot.add(whole, "params", gpu(params), where)
    only = "exact: the adapters' shards (the frozen base is off the device for a LoRA-only sync)"
    slot.add(adapters_only, "params", gpu(adapters), where if host else only)
    slot.add(whole, "buffers", denoiser.sharded_bytes(shards, "buffers"))
    trainable = sum(n * w for n, w in denoiser.trainable_shard_elements(shards, lora))
    slot.add(optimizer_on, "grads", gpu(trainable), where)
    slot.add(optimizer_on, "adam", gpu(2 * trainable), where)
    if args.use_ema:
        ema = sum(n for n, _ in denoiser.trainable_shard_elements(shards, lora)) * DTYPE_BYTES["float32"]
        served = args.ema_rollout_policy == "ema"  # the sync swaps the shadow in: it stays for it
        slot.add(on if served else whole, "ema", gpu(ema), where)
        if args.ref_mode == "ema" and TRAIN in phases:
            slot.add([TRAIN], "ema/swap_backup", gpu(trainable), where)
        if args.ema_rollout_policy == "ema" and SYNC in phases:
            slot.add([SYNC], "ema/swap_backup", gpu(trainable), where)
    if args.ref_mode == "frozen":  # the trainer's frozen copy of its start weights, sharded like the model
        slot.add(whole, "ref/frozen", gpu(params), where)
        slot.add(whole, "ref/frozen_buffers", denoiser.sharded_bytes(shards, "buffers"))
    known = METHODS.get(str(args.loss_type))  # the method table (miles.methods)
    if known is not None and known.frozen_teacher and not lora:
        teacher = gpu(denoiser.sharded_bytes(shards, "base")) + denoiser.sharded_bytes(shards, "buffers")
        slot.add(phases, "teacher", teacher, "exact: not moved by --offload-train")
        gan = float(args.dmd2_gan_loss_weight or 0)
        if gan > 0:
            width = int(config["num_attention_heads"]) * int(config["attention_head_dim"])
            head = (width * width + 4 * width + 1) * DTYPE_BYTES["float32"]
            slot.add(phases, "gan_head", 4 * head)  # params, grads, AdamW's two moments, fp32
    # transients of the train step and of the sync (not activations)
    if TRAIN in phases:
        # FSDP2 all-gathers in the forward dtype (the master dtype when they are the same)
        width = DTYPE_BYTES[dtype_name(args.diffusion_forward_dtype)]
        groups = counts.fsdp_groups(components, family.fsdp_block_lists)
        if shards == 1:
            note = "formula: one rank keeps the model gathered"
            slot.add([TRAIN], "fsdp/unsharded", denoiser.params() * width, note)
        else:
            unsharded = (groups.root + 2 * groups.largest_block) * width
            slot.add([TRAIN], "fsdp/unsharded", unsharded, "formula: root group + 2 blocks gathered (no LoRA)")
    if SYNC in phases and syncs:
        slot.add([SYNC], "sync/gather", denoiser.largest_tensor(lora_only))
        if feeds_engine and bool(args.colocate):
            largest_group = max(denoiser.sync_payload_groups(lora_only).values(), default=0)
            buffer = int(args.update_weight_buffer_size)
            bucket = max(min(buffer, largest_group), denoiser.largest_sync_unit(lora_only))
            note = EXACT if largest_group <= buffer else "bound: the largest bucket is at most this"
            slot.add([SYNC], "sync/bucket", bucket, note)
    return slot


# ---- an engine --------------------------------------------------------------------------------------------------
def engine_slot(
    label: str, args: Any, counts: ModelCounts, phases: tuple[str, ...], lora_merge: int = 0
) -> SlotStatic:
    """The pipeline; `lora_merge`: the diffusers engine's LoRA merge of one module in the sync (`merge_bytes`)."""
    slot = SlotStatic(label)
    forward = dtype_name(args.diffusion_forward_dtype)
    pipeline = 0
    for name, component in sorted(counts.components.items()):
        cast = "float32" if name == "vae" and forward != "float32" else None
        pipeline += component.total_bytes(forward, cast=cast)
    held = [p for p in phases if not (bool(args.offload_rollout) and p == TRAIN)]
    slot.add(held, "pipeline", pipeline)
    if lora_merge and SYNC in phases:
        slot.add([SYNC], "lora_merger/merge", lora_merge, "formula: one module's base on the device + fp32 merge")
    return slot


# ---- the job ----------------------------------------------------------------------------------------------------
def _transformer_config(config_dir: Path, family: Any) -> dict[str, Any]:
    path = config_dir / family.transformer_subfolder / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _job_phases(plan: Any) -> tuple[str, ...]:
    return PHASES if any(s.role == "engine" for s in plan.slots) else (TRAIN,)


def static_memory(resolved: Any, plan: Any = None, counts: Mapping[str, ModelCounts] | None = None) -> StaticMemory:
    """The static bytes of `resolved` (`miles.config.resolve.resolve(...)`) on each GPU of `plan` (default: the plan
    on the cluster the flags describe). `counts` ({checkpoint: counts}) skips the lookup (`memory.cache`)."""
    from miles.memory.cache import model_counts
    from miles.memory.config_dirs import config_dir_for
    from miles.models.families import args_family

    args = resolved.args
    if plan is None:
        from miles.placement.cluster import flags_cluster
        from miles.placement.plan import make_plan

        plan = make_plan(args, flags_cluster(args), resolved.spec)
    phases = _job_phases(plan)
    notes: list[str] = []
    counts = dict(counts or {})

    def counts_of(role_args: Any, family: Any) -> tuple[ModelCounts, Path]:
        from miles.models.pipeline_config import target_components

        checkpoint = str(role_args.hf_checkpoint)
        config_dir = config_dir_for(checkpoint, family)
        if config_dir is None:
            from miles.builtin.names import is_builtin_model

            if is_builtin_model(checkpoint):
                raise LookupError(
                    f"--hf-checkpoint {checkpoint}: the built-in model is built on its first use; its memory is "
                    "estimated once it is"
                )
            raise LookupError(
                f"--hf-checkpoint {checkpoint!r}: no local checkpoint directory and no real-size configs shipped for "
                f"it in miles (model family {family.name!r}); give a local checkpoint directory"
            )
        components = family.denoiser_components(target_components(role_args.update_weight_target_module))
        targets = [lora_targets(role_args, family)] if role_args.use_lora else []
        if checkpoint not in counts or (
            targets and any(f"{','.join(components)}|{','.join(t)}" not in counts[checkpoint].lora for t in targets)
        ):
            counts[checkpoint] = model_counts(config_dir, family, components, targets)
        return counts[checkpoint], config_dir

    engine_family = args_family(args)
    engine_counts, engine_dir = counts_of(args, engine_family)
    if engine_counts.unresolved:
        notes.append(f"not counted (class not importable here): {', '.join(engine_counts.unresolved)}")
    num_engines = len(plan.slots_of("engine"))
    per_engine = max(1, int(args.rollout_num_gpus_per_engine or 1))
    slots: dict[str, SlotStatic] = {}
    trainable: dict[str, int] = {}
    actor_denoiser: Denoiser | None = None
    for role, role_args in resolved.trainer_args.items():
        family = args_family(role_args)
        role_counts, role_dir = counts_of(role_args, family)
        denoiser, components = denoiser_of(role_counts, family, role_args)
        trainable[role] = denoiser.trainable(bool(role_args.use_lora))
        if role == "actor":
            actor_denoiser = denoiser
        config = _transformer_config(role_dir, family)
        for slot in plan.slots_of(role):
            feeds = role == "actor" and slot.index % per_engine == 0 and slot.index // per_engine < num_engines
            slots[slot.label] = trainer_slot(
                slot.label,
                role_args,
                denoiser,
                role_counts,
                family,
                components,
                phases,
                feeds,
                config,
                role == "actor",
            )
    lora_merge = 0
    backend = args.rollout_backend
    if actor_denoiser is not None and args.use_lora and args.lora_ipc_weight_sync and num_engines:
        libraries = {n: c.library for n, c in engine_counts.components.items()}
        forward = dtype_name(args.diffusion_forward_dtype)
        lora_base = actor_denoiser.adapted_base_bytes(libraries, forward)
        if backend == "sglang":  # sglang 0.5.23's LoRALinear snapshots the base weight with .to("cpu").clone()
            notes.append(
                f"sglang's LoRA merge: {gib(lora_base):.1f} GiB per engine of base-weight copies, in host memory "
                "(its LoRALinear.cpu_weight), not on the GPU"
            )
        else:
            lora_merge = actor_denoiser.merge_bytes(libraries, forward)
            notes.append(
                f"{LORA_BASE_COPIES}: {gib(lora_base):.1f} GiB per engine, the diffusers engine's copies of the "
                "adapted base weights, in pinned host memory (not on the GPU: a module's base is on the device only "
                "while it merges, lora_merger/merge)"
            )
    if backend == "sglang":
        notes.append("sglang engines: the pipeline counted as the in-process engine holds it (not measured)")
    for slot in plan.slots_of("engine"):
        slots[slot.label] = engine_slot(slot.label, args, engine_counts, phases, lora_merge)
        if len(slot.gpus) > 1:
            notes.append(f"{slot.label} spans {len(slot.gpus)} GPUs: its whole pipeline is counted on each (bound)")
    if plan.slots_of("reward"):
        notes.append("reward workers (PickScore) are not estimated: 0 bytes counted for them")
    gpus = []
    for (node, gpu), on_gpu in plan.by_gpu().items():
        entries: dict[str, list[Entry]] = {p: [] for p in phases}
        for s in on_gpu:
            for p, es in slots.get(s.label, SlotStatic(s.label)).phases.items():
                entries[p].extend(es)
        gpus.append(GpuStatic(node, gpu, [s.label for s in on_gpu], entries))
    summary = ModelSummary(
        str(args.hf_checkpoint),
        str(engine_dir),
        {name: c.parameters for name, c in sorted(engine_counts.components.items())},
        trainable,
    )
    return StaticMemory(summary, gpus, notes)


def gib(nbytes: int) -> float:
    return nbytes / GIB
