"""`TrainPipelineConfig`: the small per-model-family adapter the trainer and the engines share.

Torch-free at import: classes are named by dotted path strings and imported on use, so the
config validator can resolve a family before torch is loaded. A family is one subclass that
overrides class attributes (and, when needed, a method or two); `miles.models.families` keeps
the registry.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, ClassVar

from miles.config.errors import ConfigError


def import_dotted(path: str) -> Any:
    """Import `pkg.module.attr` (or `pkg.module:attr`) and return the attribute."""
    if ":" in path:
        module_name, _, attr_path = path.partition(":")
        obj: Any = importlib.import_module(module_name)
        for part in attr_path.split("."):
            obj = getattr(obj, part)
        return obj
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as exc:
            # Only swallow "this prefix is not a module"; a missing dependency inside it is a real error.
            if exc.name is None or not ".".join(parts[:cut]).startswith(exc.name):
                raise
            continue
        for part in parts[cut:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(f"cannot import {path!r}: expected a dotted path 'package.module.attr'")


class TrainPipelineConfig:
    """What miles needs to know about one diffusion model family.

    Attributes (class-level; a family overrides them):
      name: the registry key (`--diffusion-model-family`).
      hf_ckpt_name_patterns: lower-case substrings of a `--hf-checkpoint` name that select this family.
      pipeline_class / transformer_class: diffusers classes as dotted paths (imported lazily).
      transformer_subfolder: where the trained DiT lives inside the pipeline directory.
      lora_target_modules: default PEFT targets (`--lora-target-modules` overrides them).
      condition_inputs: the DiT forward's condition kwargs, as carried in a sample's cond dicts.
      weight_sync_targets: pipeline components pushed to the engines after an optimizer step.
      trainable: False for families registered for name resolution but without a training path yet.
      supports_cfg_training / cfg_batching: CFG in the training forward; pos and neg in one batch.
      input_dtype_policy: boundary casts {"latents", "cond", "timestep"} -> "default"/"fp32"/"bf16"/None.
      sde_timestep_divisor: sigma = timestep / divisor for CPS (None: use the scheduler's sigmas).
      timestep_input_scale: multiply the timestep by this before the DiT forward (1/1000 for [0,1] DiTs).
      optimizer_state_allowed_missing: parameter-name fragments whose optimizer state may be absent on load.
    """

    name: ClassVar[str] = "custom"
    description: ClassVar[str] = ""
    hf_ckpt_name_patterns: ClassVar[tuple[str, ...]] = ()
    pipeline_class: ClassVar[str] = "diffusers.DiffusionPipeline"
    transformer_class: ClassVar[str | None] = None
    transformer_subfolder: ClassVar[str] = "transformer"
    lora_target_modules: ClassVar[tuple[str, ...]] = ()
    condition_inputs: ClassVar[tuple[str, ...]] = ("encoder_hidden_states",)
    weight_sync_targets: ClassVar[tuple[str, ...]] = ("transformer",)
    trainable: ClassVar[bool] = True
    not_trainable_reason: ClassVar[str] = ""
    supports_cfg_training: ClassVar[bool] = True
    cfg_batching: ClassVar[bool] = False
    input_dtype_policy: ClassVar[Mapping[str, str | None]] = MappingProxyType(
        {"latents": None, "cond": None, "timestep": None}
    )
    sde_timestep_divisor: ClassVar[float | None] = None
    timestep_input_scale: ClassVar[float] = 1.0
    optimizer_state_allowed_missing: ClassVar[tuple[str, ...]] = ()

    # ---- lazy class access -------------------------------------------------------------------
    def load_pipeline_class(self) -> type:
        return import_dotted(self.pipeline_class)

    def load_transformer_class(self) -> type:
        if self.transformer_class is None:
            raise NotImplementedError(f"family {self.name!r} names no transformer class")
        return import_dotted(self.transformer_class)

    # ---- name matching -----------------------------------------------------------------------
    @classmethod
    def match_score(cls, checkpoint_name: str) -> int:
        """Length of the longest pattern found in `checkpoint_name` (lower-cased); 0 = no match."""
        lowered = checkpoint_name.lower()
        return max((len(p) for p in cls.hf_ckpt_name_patterns if p.lower() in lowered), default=0)

    # ---- training-forward helpers (tensor-generic: no torch import needed) --------------------
    def cfg_combine(self, pos: Any, neg: Any, scale: float) -> Any:
        """Classifier-free guidance: neg + scale * (pos - neg)."""
        return neg + scale * (pos - neg)

    def prepare_cond_kwargs(self, cond: Mapping[str, Any]) -> dict[str, Any]:
        """Select this family's condition inputs from a cond dict (a missing one is a KeyError)."""
        missing = [k for k in self.condition_inputs if k not in cond]
        if missing:
            raise KeyError(f"family {self.name!r}: condition inputs {missing} missing (have {sorted(cond)})")
        return {k: cond[k] for k in self.condition_inputs}

    def forward_velocity(self, transformer: Any, latents: Any, timestep: Any, cond: Mapping[str, Any]) -> Any:
        """The DiT's flow prediction for `latents` at `timestep` under condition `cond`."""
        t = timestep * self.timestep_input_scale if self.timestep_input_scale != 1.0 else timestep
        out = transformer(hidden_states=latents, timestep=t, return_dict=False, **self.prepare_cond_kwargs(cond))
        return out[0]

    # ---- training-side parallelism and attention (import torch only when called) ---------------
    def enable_sequence_parallel(self, model: Any, group: Any) -> None:
        """Shard `model`'s token sequence over the ranks of the process group `group` (`--sequence-parallel-size`).

        Contract: every rank of `group` is given the same inputs and returns the whole output; every
        cross-rank step is autograd-aware with the exact adjoint as its backward, so a rank's parameter
        gradients are its partial sums and their sum over `group` is the gradient of the sum of the ranks'
        losses. A family without a sequence-parallel plan refuses.
        """
        raise ConfigError(
            f"--sequence-parallel-size: model family {self.name!r} has no sequence-parallel plan in miles; "
            "use --sequence-parallel-size 1"
        )

    def set_attention_backend(self, model: Any, backend: str) -> None:
        """Run `model`'s attention on diffusers' attention backend `backend` (`--fsdp-attention-backend`).

        The default is diffusers' own `set_attention_backend`, which reaches the processors that dispatch
        through `dispatch_attention_fn`; a family whose processors call a kernel directly overrides it.
        """
        model.set_attention_backend(backend)

    # ---- validation --------------------------------------------------------------------------
    def check_trainable(self, selected_by: str, trainable_families: tuple[str, ...] = ()) -> None:
        """Raise ConfigError (naming `selected_by`, e.g. the flag) when this family has no training path yet."""
        if not self.trainable:
            reason = f" ({self.not_trainable_reason})" if self.not_trainable_reason else ""
            known = f"; trainable families: {', '.join(trainable_families)}" if trainable_families else ""
            raise ConfigError(
                f"{selected_by}: model family {self.name!r} is registered but not trainable in miles yet"
                f"{reason}{known}"
            )

    def summary(self) -> dict[str, Any]:
        """A JSON-friendly view, e.g. for `inspect-config`."""
        return {
            "name": self.name,
            "class": f"{type(self).__module__}.{type(self).__qualname__}",
            "pipeline_class": self.pipeline_class,
            "transformer_class": self.transformer_class,
            "lora_target_modules": list(self.lora_target_modules),
            "condition_inputs": list(self.condition_inputs),
            "weight_sync_targets": list(self.weight_sync_targets),
            "trainable": self.trainable,
        }

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"
