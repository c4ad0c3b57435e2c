"""Build a checkpoint's components at their real size on `torch.device("meta")`: no weights read, no memory
allocated, seconds even for a 20 B model.

Each `model_index.json` module is built from its own `config.json` with the class the checkpoint names (the family's
diffusers transformer, the transformers text encoders, the VAE), outside any FakeTensorMode (a fake parameter
cannot be moved or swapped: shared/reference/memory_estimation.md). `raw=True` keeps the build's tensors as the
constructors made them under a half default dtype (what `load_dtypes.tensor_groups` reads); otherwise every tensor
gets the dtype `from_pretrained(dtype=...)` would give it. The trainer's denoiser is composed by the family
(`compose_denoiser`) from its components, and LoRA is injected with the trainer's own `apply_lora`.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from miles.memory.config_dirs import listed_components
from miles.memory.load_dtypes import BUILD_DTYPE, apply_load_dtype
from miles.models.loading import quiet_loading


@dataclass(frozen=True)
class LoraSpec:
    """`--lora-rank`, `--lora-alpha`, the targets (`--lora-target-modules`, else the family's) and
    `--lora-init-weights`."""

    rank: int
    alpha: int
    targets: tuple[str, ...]
    init_weights: str = "gaussian"


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def resolve_class(library: str, class_name: str) -> tuple[str, type]:
    """(the library whose loading rules apply, the class) of a `model_index.json` entry; a pipeline-local module
    (`["ltx2", "LTX2TextConnectors"]`) lives in `diffusers.pipelines.<library>`, as diffusers resolves it."""
    try:
        module = importlib.import_module(library)
    except ImportError:
        module = importlib.import_module(f"diffusers.pipelines.{library}")
        library = "diffusers"
    return library, getattr(module, class_name)


def module_components(config_dir: Path) -> dict[str, tuple[str, type]]:
    """{name: (library, class)} of the `model_index.json` entries that are torch modules (schedulers, tokenizers
    and processors are not; an entry whose library is not installed is skipped)."""
    out = {}
    for name, library, class_name in listed_components(config_dir):
        try:
            resolved, cls = resolve_class(library, class_name)
        except (ImportError, AttributeError):
            continue
        if isinstance(cls, type) and issubclass(cls, torch.nn.Module):
            out[name] = (resolved, cls)
    return out


def unresolved_components(config_dir: Path) -> list[str]:
    """`model_index.json` entries whose class cannot be imported here (so they are neither built nor counted)."""
    out = []
    for name, library, class_name in listed_components(config_dir):
        try:
            resolve_class(library, class_name)
        except (ImportError, AttributeError):
            out.append(f"{name} ({library}.{class_name})")
    return out


def build_component(config_dir: Path, name: str, dtype: torch.dtype | None = None, *, raw: bool = False) -> Any:
    """Component `name` of `config_dir` on the meta device, its tensors in the dtypes `from_pretrained(dtype=dtype)`
    gives them (`raw`: as the constructors made them under a half default dtype)."""
    components = module_components(config_dir)
    if name not in components:
        raise KeyError(f"{config_dir}: no module component {name!r} (have {sorted(components)})")
    library, cls = components[name]
    with quiet_loading(), torch.device("meta"), default_dtype(BUILD_DTYPE):
        if library == "transformers":
            from transformers import AutoConfig

            module = cls._from_config(AutoConfig.from_pretrained(config_dir / name), dtype=BUILD_DTYPE)
        else:
            module = cls.from_config(cls.load_config(config_dir / name))
    if raw:
        return module
    return apply_load_dtype(module, library, dtype if dtype is not None else torch.float32)


def component_library(config_dir: Path, name: str) -> str:
    return module_components(config_dir)[name][0]


def engine_modules(config_dir: Path, forward_dtype: torch.dtype) -> dict[str, Any]:
    """Every module of the pipeline as the in-process engine holds it: loaded with `--diffusion-forward-dtype`, the
    VAE then moved to fp32 when that is not fp32 (`DiffusersEngine`)."""
    out = {name: build_component(config_dir, name, forward_dtype) for name in module_components(config_dir)}
    if forward_dtype != torch.float32 and "vae" in out:
        out["vae"] = out["vae"].to(torch.float32)
    return out


def compose_denoiser(modules: Mapping[str, Any], family: Any) -> torch.nn.Module:
    return family.compose_denoiser(modules)


def inject_lora(model: torch.nn.Module, lora: LoraSpec, family: Any) -> torch.nn.Module:
    """The trainer's `apply_lora` on a meta model (adapters created on meta), then each adapter in its base weight's
    dtype, as peft sets it on a real device (it skips meta modules)."""
    from miles.training.model import apply_lora

    args = SimpleNamespace(
        lora_rank=lora.rank,
        lora_alpha=lora.alpha,
        lora_target_modules=list(lora.targets),
        lora_init_weights=lora.init_weights,
    )
    with torch.device("meta"):
        model = apply_lora(model, args, family)
    match_adapter_dtypes(model)
    return model


def match_adapter_dtypes(model: torch.nn.Module) -> None:
    from peft.tuners.lora import LoraLayer

    with torch.no_grad():
        for layer in model.modules():
            if not isinstance(layer, LoraLayer):
                continue
            dtype = layer.get_base_layer().weight.dtype
            for attr in layer.adapter_layer_names:
                holder = getattr(layer, attr)
                for key in list(holder.keys()):
                    item = holder[key]
                    if isinstance(item, torch.nn.Module):
                        item.to(dtype)
                    else:
                        item.data = item.data.to(dtype)


def build_denoiser(
    config_dir: Path,
    family: Any,
    components: tuple[str, ...] = ("transformer",),
    dtype: torch.dtype = torch.float32,
    lora: LoraSpec | None = None,
) -> torch.nn.Module:
    """The trainer's module (`load_denoiser(checkpoint, dtype, components)`, then `apply_lora` when `lora`) on the
    meta device, in train mode."""
    modules = {name: build_component(config_dir, name, dtype) for name in family.denoiser_components(components)}
    model = compose_denoiser(modules, family)
    if lora is not None:
        model = inject_lora(model, lora, family)
    return model.train()
