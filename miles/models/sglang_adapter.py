"""`SglangAdapter`: what a model family tells `--rollout-backend sglang` (the server's options, a request's
fields, sglang's names and dtypes for the DiT's tensors, and its outputs back in miles' layout).
`TrainPipelineConfig` inherits it; a family overrides the attributes and, when needed, a hook.

Torch-free at import (torch only inside the hooks that take tensors).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, ClassVar


class SglangAdapter:
    """The sglang side of a model family.

    Attributes (class-level; a family overrides them):
      sglang_model_id: the `--model-id` sglang-diffusion needs to pick its native pipeline for a local dir.
      sglang_text_encoders: how many text encoders sglang's pipeline for this family loads.
      sglang_dropped_conditions: `denoising_env` condition keys not kept (geometry the DiT forward rebuilds).
      sglang_fused_modules: modules sglang's port of the DiT fuses: fused suffix -> member suffixes, whose
          tensors it holds concatenated along dim 0 in that order (what its weight checker compares).
      sglang_server_env: environment variables the family's sglang servers are started with.

    The hooks use the family's guidance (`guidance_mode`, `cfg_scale`, `embedded_guidance`), which
    `TrainPipelineConfig` defines.
    """

    guidance_mode: ClassVar[str]
    sglang_model_id: ClassVar[str | None] = None
    sglang_text_encoders: ClassVar[int] = 1  # sglang's text-encoder count (one --text-encoder-precisions each)
    sglang_dropped_conditions: ClassVar[tuple[str, ...]] = ("freqs_cis",)  # env keys the trainer rebuilds itself
    sglang_fused_modules: ClassVar[Mapping[str, tuple[str, ...]]] = MappingProxyType({})
    sglang_cpu_blocker: ClassVar[str] = ""  # why sglang cannot serve this family on CPU ("" = it can)
    sglang_server_env: ClassVar[Mapping[str, str]] = MappingProxyType({})  # environment its sglang servers need
    # modules (sglang's names) its port keeps in fp32 whatever the DiT precision: they hold what was synced (cast
    # to the DiT precision: the checkpoint's load, a written shard) widened to fp32, which the checker digests
    sglang_fp32_modules: ClassVar[tuple[str, ...]] = ()
    # the --diffusion-forward-dtype values sglang's port of the DiT runs at (empty: any), and why
    sglang_dit_precisions: ClassVar[tuple[str, ...]] = ()
    sglang_precision_reason: ClassVar[str] = ""
    sglang_unserved: ClassVar[str] = ""  # why sglang cannot serve this family's rollouts at all ("" = it can)

    def sglang_server_options(self, precision: str, guidance_scale: float | None = None) -> dict[str, Any]:
        """`sglang serve` options this family needs: one precision per text encoder and, under embedded
        guidance, `--embedded-cfg-scale` (sglang reads that guidance from the server, not the request)."""
        options: dict[str, Any] = {"text_encoder_precisions": [precision] * self.sglang_text_encoders}
        embedded = None if guidance_scale is None else self.embedded_guidance(guidance_scale)
        if embedded is not None:
            options["embedded_cfg_scale"] = embedded
        return options

    def sglang_request_fields(self, guidance_scale: float, true_cfg_scale: float | None = None) -> dict[str, float]:
        """The `/rollout/generate` fields that carry guidance. sglang runs a negative branch when
        `true_cfg_scale` (else `guidance_scale`) is > 1, at that scale: plain CFG sends the guidance scale,
        the other modes also send `cfg_scale(...)` as `true_cfg_scale` (1.0: one branch)."""
        fields = {"guidance_scale": float(guidance_scale)}
        if self.guidance_mode != "cfg":
            fields["true_cfg_scale"] = self.cfg_scale(guidance_scale, true_cfg_scale)
        return fields

    def engine_module(self, module: str) -> tuple[str, list[str]]:
        """(the name sglang's port of the DiT gives module `module`, the modules whose tensors make it up):
        a member of a fused module maps to the fused one and its members, any other module to itself (a family
        may rename it, or give "" for a module its port drops)."""
        for fused, members in self.sglang_fused_modules.items():
            for member in members:
                if module == member or module.endswith("." + member):
                    prefix = module[: len(module) - len(member)]
                    return prefix + fused, [prefix + m for m in members]
        return module, [module]

    def to_engine_tensors(self, tensors: Mapping[str, Any]) -> dict[str, Any]:
        """Named DiT tensors -> the names and tensors sglang's port holds (its weight checker's view): renamed
        as `engine_module` says, a dropped module left out, the members of a fused module concatenated along
        dim 0 under the fused name (a fused module must come with all its members)."""
        import torch

        out: dict[str, Any] = {}
        groups: dict[str, list[str]] = {}
        for name, tensor in tensors.items():
            module, dot, leaf = name.rpartition(".")
            engine, members = self.engine_module(module)
            if module and not engine:
                continue  # a module sglang's port drops
            if len(members) == 1:
                out[f"{engine}{dot}{leaf}"] = tensor  # renamed, or the same name
            else:
                groups[f"{engine}.{leaf}"] = [f"{m}.{leaf}" for m in members]
        for name, parts in groups.items():
            missing = [p for p in parts if p not in tensors]
            if missing:
                raise ValueError(f"{name} (fused by sglang) needs {missing} too")
            out[name] = torch.cat([tensors[p] for p in parts])
        return out

    def engine_dtype(self, name: str, dtype: Any) -> Any:
        """The dtype sglang's port holds tensor `name` (its name) in when it serves at `dtype`: fp32 for the
        `sglang_fp32_modules`, else `dtype`."""
        if any(name == m or name.startswith(m + ".") for m in self.sglang_fp32_modules):
            import torch

            return torch.float32
        return dtype

    def sglang_blocker(self, guidance_scale: float, true_cfg_scale: float | None, max_sequence_length: int) -> str:
        """Why sglang would not sample what this family's pipeline samples with these settings and a checkpoint of
        text length `max_sequence_length` ("" when it would). The config rules refuse `--rollout-backend sglang`
        with the reason. Default: nothing stands in the way."""
        return ""

    def sglang_sampling_params(self, max_sequence_length: int) -> dict[str, Any]:
        """A request's `extra_sampling_params` that make sglang encode text the way this family's diffusers
        pipeline does at `max_sequence_length` (the checkpoint's). Default: none (sglang's own lengths)."""
        return {}

    def from_engine_conditions(
        self, cond_kwargs: Mapping[str, Any], env: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """One output's condition rows from sglang's `denoising_env` (`cond_kwargs` is its `pos_cond_kwargs`
        or `neg_cond_kwargs`, `env` the whole env): tensors only, float32, without a batch dim of 1; a
        one-tensor list is that tensor (sglang passes some pipelines' embeds per text encoder); other
        non-tensors (RoPE tables, shapes, lengths) and `sglang_dropped_conditions` are dropped."""
        import torch

        rows: dict[str, Any] = {}
        for key, value in cond_kwargs.items():
            if isinstance(value, (list, tuple)) and len(value) == 1:
                value = value[0]
            if key in self.sglang_dropped_conditions or not isinstance(value, torch.Tensor):
                continue
            tensor = value.float()
            rows[key] = tensor[0].clone() if tensor.dim() >= 2 and tensor.shape[0] == 1 else tensor.clone()
        return rows

    def from_engine_image(self, image: Any) -> Any:
        """sglang's `generated_output` of one output -> what `decode_latents` gives for one sample (`[3, H, W]`
        in [0, 1]), float32. Default: already that."""
        return image.float()

    def from_engine_latents(self, latents: Any, height: int, width: int) -> Any:
        """sglang's `dit_trajectory.latents` of one output -> `[T+1, *latent_shape]` in the natural layout,
        float32 (`height` x `width` is the image size). Default: already natural."""
        return latents.float()
