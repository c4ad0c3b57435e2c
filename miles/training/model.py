"""Loading the trained DiT: the family's transformer from `--hf-checkpoint`, LoRA, FSDP2 wrapping."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch

from miles.core.inputs import input_path
from miles.models.families import args_family
from miles.models.loading import DTYPE_NAMES, torch_dtype
from miles.models.lora_sync import merge_lora_weight
from miles.models.pipeline_config import TrainPipelineConfig

DTYPES = {name: torch_dtype(name) for name in DTYPE_NAMES}


def family_of(args: Any) -> TrainPipelineConfig:
    family = args_family(args, require_trainable=True)
    family.bind_args(args)  # run settings the forward reads (e.g. --rollout-patch-group), as the engine does
    return family


def target_components(args: Any) -> tuple[str, ...]:
    """`--update-weight-target-module`: the denoiser components to load, train and sync."""
    from miles.models.pipeline_config import target_components as parse

    return parse(args.update_weight_target_module)


MODEL_BACKEND_FLAG = "--model-backend-path"


class ModelBackend:
    """The trainer's model loader; `--model-backend-path pkg.module.MyBackend` names a subclass, built as
    `cls(args, family)`. `load_denoiser(checkpoint_dir, dtype, components) -> torch.nn.Module` returns the
    DiT to train (`components`: the `--update-weight-target-module` names). The default delegates to the
    family (`TrainPipelineConfig.load_denoiser`). LoRA, FSDP2 and the schedule stay with the trainer and
    the family; the engines still serve `--hf-checkpoint`, so the module's weight names must match theirs
    for the weight sync."""

    def __init__(self, args: Any, family: TrainPipelineConfig) -> None:
        self.args, self.family = args, family

    def load_denoiser(self, checkpoint_dir: str, dtype: torch.dtype, components: tuple[str, ...]) -> torch.nn.Module:
        return self.family.load_denoiser(checkpoint_dir, dtype, components)


def model_backend(args: Any, family: TrainPipelineConfig) -> ModelBackend:
    """The `--model-backend-path` class (a `ModelBackend` subclass) built on (args, family), else `ModelBackend`."""
    path = args.model_backend_path
    if not path:
        return ModelBackend(args, family)
    from miles.core.errors import ConfigError
    from miles.utils.hooks import load_class

    cls = load_class(path, MODEL_BACKEND_FLAG)
    if not issubclass(cls, ModelBackend):
        raise ConfigError(
            f"{MODEL_BACKEND_FLAG} {path!r}: {cls.__name__} is not a subclass of miles.training.model.ModelBackend"
        )
    return cls(args, family)


def load_transformer(args: Any, family: TrainPipelineConfig, checkpoint: Any = None) -> torch.nn.Module:
    """The DiT (the family's denoiser: the transformer, or the experts `--update-weight-target-module` names)
    in the master dtype (`--fsdp-master-dtype`), in train mode."""
    checkpoint = input_path(args, checkpoint if checkpoint is not None else args.hf_checkpoint)
    backend = model_backend(args, family)
    model = backend.load_denoiser(os.fspath(checkpoint), DTYPES[args.fsdp_master_dtype], target_components(args))
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"{MODEL_BACKEND_FLAG} {args.model_backend_path!r}: load_denoiser returned {type(model).__name__}, "
            "not a torch.nn.Module"
        )
    if args.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    return model.train()


def enable_gradient_checkpointing(model: torch.nn.Module) -> None:
    """diffusers' gradient checkpointing on the denoiser, or on each of its experts (a composed module)."""
    for module in [model, *model.children()]:
        if hasattr(module, "enable_gradient_checkpointing"):
            module.enable_gradient_checkpointing()


def submodules(model: torch.nn.Module, path: str) -> list[torch.nn.Module]:
    """The blocks at dotted attribute `path` of `model` (an empty list when any part is missing)."""
    obj: Any = model
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return []
    return list(obj)


def lora_targets(args: Any, family: TrainPipelineConfig) -> list[str]:
    return list(args.lora_target_modules or family.lora_target_modules)


@contextlib.contextmanager
def adapters_off(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Run `model` as its LoRA base: every peft LoRA layer skips its adapter inside the block.

    Only the flag peft's forward reads is flipped. `LoraLayer.enable_adapters` also flips
    `requires_grad`, which under FSDP2 lands on whichever parameters (sharded or unsharded) are
    registered at that moment and loses the adapters' gradients after the next reshard.
    """
    from peft.tuners.lora import LoraLayer

    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield model
    finally:
        for layer in layers:
            layer._disable_adapters = False


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """`--ref-mode frozen`: a copy of the (not yet sharded) trained module as it starts, LoRA adapters included, in
    eval mode with no parameter requiring grad (the trainer shards it like the model and never updates it)."""
    import copy

    frozen = copy.deepcopy(model).eval()
    frozen.requires_grad_(False)
    return frozen


def apply_lora(model: torch.nn.Module, args: Any, family: TrainPipelineConfig) -> torch.nn.Module:
    """Attach one peft LoRA adapter ("default") and freeze everything else."""
    from peft import LoraConfig, inject_adapter_in_model

    init = args.lora_init_weights
    init_arg: Any = True if init in ("kaiming-uniform", "kaiming_uniform", "true") else init
    config = LoraConfig(
        r=args.lora_rank,
        lora_alpha=args.lora_alpha,
        target_modules=lora_targets(args, family),
        init_lora_weights=init_arg,
        lora_dropout=0.0,
    )
    model.requires_grad_(False)
    model = inject_adapter_in_model(config, model)
    for name, param in model.named_parameters():
        param.requires_grad_("lora_" in name)
    return model


def parallelize_attention(model: torch.nn.Module, args: Any, family: TrainPipelineConfig, sp_group: Any) -> None:
    """`--fsdp-attention-backend` and Ulysses sequence parallelism over `sp_group`, through the family's plan.
    Called inside the trainer rank: a backend that needs a device the rank lacks is refused here."""
    from miles.training.parallel import check_attention_backend_device

    if args.fsdp_attention_backend:
        check_attention_backend_device(args.fsdp_attention_backend, torch.cuda.is_available())
        family.set_attention_backend(model, args.fsdp_attention_backend)
    if sp_group is not None:
        family.enable_sequence_parallel(model, sp_group)


def shard(
    model: torch.nn.Module, args: Any, mesh: Any = None, block_lists: tuple[str, ...] = ("transformer_blocks",)
) -> torch.nn.Module:
    """FSDP2: shard every block of the family's block lists (`fsdp_block_lists`), then the root, with the
    dtype policy of the flags, over `mesh` (None: FSDP2's default 1-D mesh over the world; HSDP passes the
    2-D (dp_replicate, dp_shard) mesh)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    forward = DTYPES[args.diffusion_forward_dtype]
    master = DTYPES[args.fsdp_master_dtype]
    policy = MixedPrecisionPolicy(
        param_dtype=None if forward == master else forward,
        reduce_dtype=DTYPES[args.fsdp_reduce_dtype],
        cast_forward_inputs=forward != master,
    )
    kwargs: dict[str, Any] = {"mp_policy": policy}
    if mesh is not None:
        kwargs["mesh"] = mesh
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() == 1:
        # One rank holds the whole model anyway: keep it gathered between forward and backward.
        kwargs["reshard_after_forward"] = False
    if args.fsdp_cpu_offload:
        # pinned host memory speeds up host-device copies; there is none to pin on a CPU-only rank
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    import warnings

    # FLUX's and Qwen-Image's forwards return a view of their last projection; FSDP2 warns that an in-place
    # op on it would skip the backward hook. Every forward_velocity uses the output out of place.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor", category=UserWarning)
    # one rank without CPU offload: the root alone, one parameter group (per-block groups would add their
    # hooks and copies to every micro-step for nothing to shard or stream: 4 % of a tiny-sd3 step on 2 cores)
    alone = dist.is_initialized() and dist.get_world_size() == 1 and not args.fsdp_cpu_offload
    if not alone:
        for name in block_lists:
            for block in submodules(model, name):
                fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer as a full CPU tensor (gathers FSDP2 shards; call on every rank)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        out[name] = tensor.detach().to("cpu").clone()
    return out


def merged_base_state_dict(state: dict[str, torch.Tensor], args: Any) -> dict[str, torch.Tensor]:
    """LoRA folded into the base weights (W + alpha/r * B @ A), under the plain module names."""
    scaling = args.lora_alpha / args.lora_rank
    merged: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if "lora_" in name:
            continue
        if name.endswith(".base_layer.weight"):
            prefix = name[: -len(".base_layer.weight")]
            a = state.get(f"{prefix}.lora_A.default.weight")
            b = state.get(f"{prefix}.lora_B.default.weight")
            merged[f"{prefix}.weight"] = tensor if a is None or b is None else merge_lora_weight(tensor, a, b, scaling)
        elif ".base_layer." in name:
            merged[name.replace(".base_layer.", ".")] = tensor
        else:
            merged[name] = tensor
    return merged


def lora_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if "lora_" in k}
