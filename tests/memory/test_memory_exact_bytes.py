"""For every shipped GPU recipe, the static estimate's parameter, buffer, gradient, AdamW, EMA, teacher and engine
bytes equal the sums over the modules built on the meta device exactly as the trainer and the engine build them
(the family's classes, the load dtypes, the trainer's `apply_lora`), sharded as FSDP2 shards them; in the sync of a
LoRA-only job under --offload-train the trainer's parameters are its trainable (adapter) shards only."""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from miles.config.resolve import resolve
from miles.memory.config_dirs import config_dir_for
from miles.memory.meta_build import LoraSpec, build_denoiser, engine_modules
from miles.memory.shipped import shipped_recipes
from miles.memory.static import lora_targets, shard_group_size, static_memory
from miles.models.families import resolve_family
from miles.models.loading import torch_dtype
from miles.models.lora_sync import lora_only_sync
from miles.models.pipeline_config import target_components

torch.set_num_threads(1)


def _elem(t: torch.Tensor) -> int:
    return t.element_size()


def _shard(t: torch.Tensor, shards: int) -> int:
    """Rank 0's elements of the FSDP2 shard of `t` (dim 0 chunked over `shards`)."""
    dim0 = t.shape[0] if t.dim() else 1
    return math.ceil(dim0 / shards) * (t.numel() // dim0)


@functools.lru_cache(maxsize=4)
def _denoiser(config_dir: Path, family_name: str, components: tuple, master: str, lora: LoraSpec | None) -> Any:
    family = resolve_family(None, family=family_name)
    return build_denoiser(config_dir, family, components, torch_dtype(master), lora)


@functools.lru_cache(maxsize=2)
def _engine(config_dir: Path, forward: str) -> dict[str, Any]:
    return engine_modules(config_dir, torch_dtype(forward))


def _module_bytes(module: torch.nn.Module, shards: int) -> dict[str, int]:
    params = list(module.parameters())
    trainable = [p for p in params if p.requires_grad]
    grads = sum(_shard(p, shards) * _elem(p) for p in trainable)
    return {
        "params": sum(_shard(p, shards) * _elem(p) for p in params),
        "buffers": sum(b.numel() * _elem(b) for b in module.buffers()),
        "grads": grads,
        "adam": 2 * grads,
        "ema": sum(_shard(p, shards) * 4 for p in trainable),
    }


def _entries(memory, label: str, phase: str = "train") -> dict[str, int]:
    gpu = next(g for g in memory.gpus if label in g.slots)
    return {e.name: e.bytes for e in gpu.phases[phase] if e.owner == label}


@pytest.mark.slow  # builds real-size models on meta: seconds each
@pytest.mark.parametrize("recipe", sorted(name for name, _, _ in shipped_recipes()))
def test_static_bytes_equal_the_meta_modules(recipe: str) -> None:
    resolved = resolve(None, recipe=recipe)
    memory = static_memory(resolved)
    for role, args in resolved.trainer_args.items():
        family = resolve_family(args.hf_checkpoint, family=args.diffusion_model_family)
        config_dir = config_dir_for(args.hf_checkpoint, family)
        components = family.denoiser_components(target_components(args.update_weight_target_module))
        lora = LoraSpec(args.lora_rank, args.lora_alpha, lora_targets(args, family)) if args.use_lora else None
        model = _denoiser(config_dir, family.name, components, args.fsdp_master_dtype, lora)
        shards = shard_group_size(args)
        want = _module_bytes(model, shards)
        got = _entries(memory, f"{role} 0")
        assert memory.model.trainable[role] == sum(p.numel() for p in model.parameters() if p.requires_grad)
        for name in ("params", "buffers", "grads", "adam"):
            assert got[name] == want[name], (role, name)
        assert got.get("ema", 0) == (want["ema"] if args.use_ema else 0)
        if args.loss_type == "dmd2_critic" and not args.use_lora:
            assert got["teacher"] == want["params"] + want["buffers"]  # a second, frozen copy of the full model
        sync = _entries(memory, f"{role} 0", "sync") if resolved.spec.generates else {}
        if sync and not args.fsdp_cpu_offload:  # before a LoRA-only sync only the trainable shards stay
            whole = not (args.offload_train and lora_only_sync(args))
            assert sync["params"] == (want["params"] if whole else want["grads"]), role
            assert ("buffers" in sync) == whole, role
    engines = [s for g in memory.gpus for s in g.slots if s.startswith("engine")]
    if engines:
        args = resolved.args
        family = resolve_family(args.hf_checkpoint, family=args.diffusion_model_family)
        modules = _engine(config_dir_for(args.hf_checkpoint, family), args.diffusion_forward_dtype)
        pipeline = sum(t.numel() * _elem(t) for m in modules.values() for t in [*m.parameters(), *m.buffers()])
        assert _entries(memory, engines[0], "rollout")["pipeline"] == pipeline
