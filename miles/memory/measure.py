"""Counts from meta-device builds (`meta_build`): each component's tensors, the LoRA adapters the trainer's
`apply_lora` injects for given targets, and the FSDP2 block groups of the denoiser. Torch; seconds per model."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from miles.memory.config_dirs import config_hash
from miles.memory.counts import (
    AdapterGroup,
    ComponentCounts,
    FsdpGroups,
    ModelCounts,
    fsdp_key,
    library_versions,
    lora_key,
)
from miles.memory.load_dtypes import pin_of, tensor_groups
from miles.memory.meta_build import (
    LoraSpec,
    build_component,
    inject_lora,
    module_components,
    unresolved_components,
)

PROBE_RANK = 4  # adapter sizes are linear in the rank: any rank gives the per-rank coefficients


def measure_components(config_dir: Path) -> dict[str, ComponentCounts]:
    out = {}
    for name, (library, cls) in module_components(config_dir).items():
        module = build_component(config_dir, name, raw=True)
        out[name] = ComponentCounts(library, cls.__name__, tensor_groups(module, library))
    return out


def _raw_denoiser(config_dir: Path, family: Any, components: tuple[str, ...]) -> tuple[Any, dict[str, Any]]:
    modules = {name: build_component(config_dir, name, raw=True) for name in components}
    return family.compose_denoiser(modules), modules


def _unique_numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def fsdp_groups(model: torch.nn.Module, block_lists: Iterable[str]) -> FsdpGroups:
    """Parameter counts of the blocks FSDP2 shards one by one (`miles.training.model.shard`), and the root's."""
    from miles.training.model import submodules

    sizes: dict[int, int] = {}
    in_blocks = 0
    for path in block_lists:
        for block in submodules(model, path):
            n = _unique_numel(block)
            sizes[n] = sizes.get(n, 0) + 1
            in_blocks += n
    return FsdpGroups(tuple(sorted(sizes.items(), reverse=True)), _unique_numel(model) - in_blocks)


def adapter_groups(
    model: torch.nn.Module, modules: dict[str, Any], libraries: dict[str, str], rank: int
) -> tuple[AdapterGroup, ...]:
    """The LoRA pairs of a peft-injected model, grouped by shape and pin (rank-free)."""
    from peft.tuners.lora import LoraLayer

    single = next(iter(modules)) if len(modules) == 1 and model is next(iter(modules.values())) else None
    caches: dict[str, dict[str, Any]] = {}
    groups: dict[tuple[str, int, int, int, str], int] = {}
    for name, layer in model.named_modules():
        if not isinstance(layer, LoraLayer) or not layer.lora_A:
            continue
        if single is not None:
            component, inner = single, name
        else:
            component, _, inner = name.partition(".")
        a = next(iter(layer.lora_A.values())).weight
        b = next(iter(layer.lora_B.values())).weight
        base = f"{inner}.weight" if inner else "weight"
        pin = pin_of(base, libraries[component], modules[component], caches.setdefault(component, {}))
        key = (component, a.numel() // rank, int(b.shape[0]), b.numel() // (int(b.shape[0]) * rank), pin)
        groups[key] = groups.get(key, 0) + 1
    return tuple(AdapterGroup(c, ar, br, bs, n, pin) for (c, ar, br, bs, pin), n in sorted(groups.items()))


def measure_denoiser(
    config_dir: Path,
    family: Any,
    components: tuple[str, ...],
    targets_sets: Iterable[tuple[str, ...]],
    block_lists: Iterable[str],
) -> tuple[dict[str, tuple[AdapterGroup, ...]], dict[str, FsdpGroups]]:
    """The FSDP2 groups of the denoiser of `components`, and its LoRA pairs for each target set."""
    libraries = {name: lib for name, (lib, _) in module_components(config_dir).items()}
    model, modules = _raw_denoiser(config_dir, family, components)
    fsdp = {fsdp_key(components, block_lists): fsdp_groups(model, block_lists)}
    lora = {}
    for targets in targets_sets:
        model, modules = _raw_denoiser(config_dir, family, components)
        model = inject_lora(model, LoraSpec(PROBE_RANK, PROBE_RANK, tuple(targets)), family)
        lora[lora_key(components, targets)] = adapter_groups(model, modules, libraries, PROBE_RANK)
    return lora, fsdp


def measure(
    config_dir: Path,
    family: Any,
    components: tuple[str, ...],
    targets_sets: Iterable[tuple[str, ...]] = (),
) -> ModelCounts:
    """Everything, from scratch: components, the denoiser's FSDP2 groups and LoRA pairs per target set."""
    counts = ModelCounts(config_hash(config_dir), library_versions(), measure_components(config_dir))
    counts.unresolved = tuple(unresolved_components(config_dir))
    lora, fsdp = measure_denoiser(config_dir, family, components, targets_sets, family.fsdp_block_lists)
    counts.lora.update(lora)
    counts.fsdp.update(fsdp)
    return counts
