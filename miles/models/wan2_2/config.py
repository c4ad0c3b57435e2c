"""The `wan2_2` family: Wan2.2-T2V-A14B and the embedded `tiny-wan2_2`, text-to-video with two experts.

Torch-free at import. What differs from the image families, all inside this config:
  * 5-D latents `[B, C, f, h, w]` (f = (frames - 1) / the VAE's temporal factor + 1), decoded to videos
    `[B, 3, F, H, W]` (one frame: an image `[B, 3, H, W]`); the VAE normalises per channel;
  * two experts (`miles.models.wan2_2.experts.WanExperts`): `transformer` for t >= boundary_ratio * 1000,
    `transformer_2` below, with `--diffusion-guidance-scale-2` for the low-noise one; CFG runs when the
    first scale is > 1 (as `WanPipeline`); `--update-weight-target-module` names the experts a job loads,
    trains and syncs, and confines SDE steps to theirs;
  * the hub checkpoint ships UniPC (multistep, not a Gaussian step): rollouts step with Euler on the same
    shifted grid (`flow_shift`), as sglang does; the timestep goes to the DiT unscaled (0..1000);
  * UMT5 text states padded to the text length with zeros (no mask), as `WanPipeline` encodes them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any, ClassVar

from miles.models.families import register_train_pipeline_config
from miles.models.pipeline_config import TrainPipelineConfig

EXPERTS = ("transformer", "transformer_2")
_ATTN = tuple(f"{a}.{p}" for a in ("attn1", "attn2") for p in ("to_q", "to_k", "to_v", "to_out.0"))
WAN_LORA_TARGET_MODULES: tuple[str, ...] = (*_ATTN, "ffn.net.0.proj", "ffn.net.2")


# diffusers' Wan block modules -> the original checkpoint's, which ComfyUI's Wan model uses (the inverse of
# diffusers' `_convert_non_diffusers_wan_lora_to_diffusers`)
_COMFYUI_BLOCK_MODULES = {
    **{f"attn1.{d}": f"self_attn.{o}" for d, o in zip(("to_q", "to_k", "to_v", "to_out.0"), "qkvo", strict=True)},
    **{f"attn2.{d}": f"cross_attn.{o}" for d, o in zip(("to_q", "to_k", "to_v", "to_out.0"), "qkvo", strict=True)},
    "attn2.add_k_proj": "cross_attn.k_img",
    "attn2.add_v_proj": "cross_attn.v_img",
    "ffn.net.0.proj": "ffn.0",
    "ffn.net.2": "ffn.2",
}


@register_train_pipeline_config("wan2_2")
class Wan22TrainPipelineConfig(TrainPipelineConfig):
    description = "Wan2.2 text-to-video (two experts: transformer for high noise, transformer_2 for low noise)"
    hf_ckpt_name_patterns = ("wan2.2", "wan2_2", "wan2-2", "wan22")
    pipeline_class = "diffusers.WanPipeline"
    transformer_class = "diffusers.WanTransformer3DModel"
    fsdp_block_lists = ("transformer.blocks", "transformer_2.blocks")
    lora_target_modules = WAN_LORA_TARGET_MODULES
    condition_inputs = ("encoder_hidden_states",)
    weight_sync_targets = EXPERTS
    experts = EXPERTS
    makes_video = True
    cfg_batching = False
    sde_timestep_divisor = 1000.0
    max_sequence_length = 512
    trainable = True
    sglang_model_id = "Wan2.2-T2V-A14B-Diffusers"
    # the expert boundary where a checkpoint's model_index.json is not at hand (Wan2.2-T2V-A14B's)
    default_boundary_ratio: ClassVar[float] = 0.875

    def comfyui_lora_module(self, module: str) -> str:
        """`transformer.blocks.3.attn1.to_q` -> `diffusion_model.blocks.3.self_attn.q` (one file per expert)."""
        parts = module.split(".", 3)  # transformer, blocks, 3, attn1.to_q
        inner = _COMFYUI_BLOCK_MODULES.get(parts[3]) if len(parts) == 4 and parts[1] == "blocks" else None
        if inner is None:
            raise ValueError(f"{module}: no ComfyUI name for this Wan module (only the blocks' attention and FFN)")
        return f"diffusion_model.blocks.{parts[2]}.{inner}"

    # ---- schedule: Euler on the checkpoint's shifted grid --------------------------------------------
    def schedule(
        self, scheduler: Any, num_steps: int, latent_shape: tuple[int, ...], flow_shift: float | None = None
    ) -> tuple[Any, Any]:
        """A UniPC checkpoint steps with FlowMatchEuler at its `flow_shift` (`--diffusion-flow-shift` replaces
        it); a flow-matching Euler checkpoint as the base class sets it."""
        if "flow_shift" not in scheduler.config:
            return super().schedule(scheduler, num_steps, latent_shape, flow_shift)
        from diffusers import FlowMatchEulerDiscreteScheduler

        from miles.models.pipeline_config import scheduler_schedule

        shift = float(flow_shift if flow_shift is not None else scheduler.config.flow_shift)
        euler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=scheduler.config.num_train_timesteps, shift=shift)
        euler.set_timesteps(num_steps, device="cpu")
        return scheduler_schedule(euler)

    def grid_schedule(
        self,
        scheduler_config: Mapping[str, Any],
        num_steps: int,
        token_count: Any = None,
        flow_shift: float | None = None,
    ) -> tuple[list[float], list[float]]:
        """`schedule` without torch: a UniPC config steps FlowMatchEuler at its `flow_shift` (or `flow_shift`)."""
        from miles.models.scheduler_grid import FLOW_MATCH_EULER, flow_match_euler_grid, live_scheduler_config

        config = live_scheduler_config(scheduler_config)
        if "flow_shift" not in config:
            return super().grid_schedule(config, num_steps, token_count, flow_shift)
        shift = float(flow_shift if flow_shift is not None else config["flow_shift"])
        euler = {"_class_name": FLOW_MATCH_EULER, "num_train_timesteps": config["num_train_timesteps"], "shift": shift}
        sigmas, timesteps = flow_match_euler_grid(euler, num_steps)
        return [float(x) for x in sigmas], [float(x) for x in timesteps]

    def grid_experts(
        self, timesteps: Any, model_index: Mapping[str, Any] | None, scheduler_config: Mapping[str, Any]
    ) -> list[str | None]:
        """Each step's expert as `WanExperts` routes it: `transformer` where the fp32 timestep is >= the boundary
        (`boundary_ratio` of model_index.json x the scheduler's train timesteps, as `WanExperts.of_pipeline`
        reads them from the pipeline: a model_index without the ratio gives boundary 0; no model_index at all:
        `default_boundary_ratio`, Wan2.2-T2V-A14B's 0.875), else `transformer_2`."""
        import numpy as np

        ratio = self.default_boundary_ratio if model_index is None else model_index.get("boundary_ratio")
        steps = scheduler_config.get("num_train_timesteps", 1000)
        boundary = np.float32(0.0 if ratio is None else float(ratio) * float(steps))
        return [EXPERTS[0] if np.float32(t) >= boundary else EXPERTS[1] for t in timesteps]

    def trainable_steps(self, sigmas: Any, timesteps: Any, components: tuple[str, ...]) -> list[int] | None:
        if set(EXPERTS) <= set(components):
            return None
        from miles.models.wan2_2.experts import HIGH

        boundary = self.boundary
        return [
            i for i, t in enumerate(timesteps.tolist()) if (HIGH if t >= boundary else "transformer_2") in components
        ]

    boundary: float = 875.0  # set from the checkpoint by `bind_checkpoint`

    def trainable_sigma_range(self, components: tuple[str, ...]) -> tuple[float, float] | None:
        if set(EXPERTS) <= set(components):
            return None
        edge = self.boundary / 1000.0
        return (edge, 1.0) if "transformer" in components else (0.0, edge)

    def bind_checkpoint(self, checkpoint: Any) -> None:
        """Read the expert boundary (model_index `boundary_ratio` x the scheduler's train timesteps)."""
        from miles.models.wan2_2.experts import boundary_timestep

        ratio, steps = _boundary_config(checkpoint, self.default_boundary_ratio)
        self.boundary = boundary_timestep(ratio, steps)

    # ---- the experts ------------------------------------------------------------------------------
    def denoiser(self, pipe: Any) -> Any:
        from miles.models.wan2_2.experts import WanExperts

        experts = WanExperts.of_pipeline(pipe)
        self.boundary = experts.boundary_timestep
        return experts

    def load_denoiser(self, checkpoint: Any, dtype: Any, components: tuple[str, ...] = EXPERTS) -> Any:
        from miles.models.loading import quiet_loading
        from miles.models.wan2_2.experts import WanExperts, boundary_timestep

        cls = self.load_transformer_class()
        with quiet_loading():
            experts = {
                name: cls.from_pretrained(os.fspath(checkpoint), subfolder=name, dtype=dtype)
                for name in EXPERTS
                if name in components
            }
        ratio, steps = _boundary_config(checkpoint, self.default_boundary_ratio)
        self.boundary = boundary_timestep(ratio, steps)
        return WanExperts(experts, self.boundary)

    def compose_denoiser(self, modules: Mapping[str, Any]) -> Any:
        from miles.models.wan2_2.experts import WanExperts

        return WanExperts(dict(modules), self.boundary)

    def split_denoiser_state(self, state: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for key, value in state.items():
            name, _, rest = key.partition(".")
            if name not in EXPERTS:
                raise KeyError(f"{key!r} belongs to no Wan expert {EXPERTS}")
            out.setdefault(name, {})[rest] = value
        return out

    # ---- text ----------------------------------------------------------------------------------------
    def encode_prompts(
        self,
        pipe: Any,
        prompts: list[str],
        negative_prompt: str | None,
        do_cfg: bool,
        max_sequence_length: int,
        guidance: float | None = None,
        geometry: Any = None,  # the output's size / frames / fps (for templates that state them)
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """UMT5 states (zero past each prompt's tokens); the negative prompt defaults to "" as in WanPipeline."""
        pos, neg = pipe.encode_prompt(
            prompt=prompts,
            negative_prompt=[negative_prompt or ""] * len(prompts) if do_cfg else None,
            do_classifier_free_guidance=do_cfg,
            max_sequence_length=max_sequence_length,
            device=pipe._execution_device,
        )
        return {"encoder_hidden_states": pos}, ({"encoder_hidden_states": neg} if do_cfg else None)

    def config_pipe(self, configs: Any) -> Any:
        """WanPipeline's factors: the VAE config's `scale_factor_temporal` / `scale_factor_spatial` (diffusers'
        defaults 4 and 8 when the config leaves them out)."""
        pipe = super().config_pipe(configs)
        vae = configs.get("vae", {})
        pipe.vae_scale_factor_temporal = int(vae.get("scale_factor_temporal") or 4)
        pipe.vae_scale_factor_spatial = int(vae.get("scale_factor_spatial") or 8)
        return pipe

    def example_conditions(self, configs: Any, text_length: int) -> dict[str, Any]:
        """UMT5 states zero-padded to `text_length` tokens, the experts' `text_dim` wide."""
        expert = next(configs[name] for name in EXPERTS if name in configs)
        return {"encoder_hidden_states": ((int(text_length), int(expert["text_dim"])), None)}

    # ---- forward ---------------------------------------------------------------------------------------
    def row_guidance(
        self, transformer: Any, latents: Any, timestep: Any, cfg_scale: float, cfg_scale_2: float | None
    ) -> Any:
        """Each row at its expert's scale: `cfg_scale` for t >= the boundary, `cfg_scale_2` (default: the first)
        below it. CFG itself runs when the first scale is > 1 (WanPipeline's rule, the base class's)."""
        if cfg_scale_2 is None:
            return float(cfg_scale)
        import torch

        boundary = getattr(transformer, "boundary_timestep", self.boundary)
        high = timestep.reshape(-1) >= boundary
        if not bool(high.any()):
            return float(cfg_scale_2)
        if bool(high.all()):
            return float(cfg_scale)
        rows = torch.where(high, float(cfg_scale), float(cfg_scale_2)).to(torch.float32)
        return rows.view(-1, *([1] * (latents.dim() - 1))).to(latents.device)

    # ---- the video VAE -------------------------------------------------------------------------------
    def latent_channels(self, pipe: Any) -> int:
        return int(pipe.vae.config.z_dim)

    def latent_shape(self, pipe: Any, height: int, width: int, num_frames: int = 1) -> tuple[int, ...]:
        spatial, temporal = int(pipe.vae_scale_factor_spatial), int(pipe.vae_scale_factor_temporal)
        experts = [getattr(pipe, n, None) for n in EXPERTS]
        patch = next((tuple(e.config.patch_size) for e in experts if e is not None), (1, 2, 2))
        factor = spatial * int(patch[1])  # whole patches of latent cells
        grid = self.video_latent_grid(height, width, num_frames, spatial, temporal, factor)
        return (self.latent_channels(pipe), *grid)

    def _stats(self, vae: Any, like: Any) -> tuple[Any, Any]:
        import torch

        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(like.device, like.dtype)
        std = torch.tensor(vae.config.latents_std).view(shape).to(like.device, like.dtype)
        return mean, std

    def encode_images(self, pipe: Any, pixels: Any) -> Any:
        """Videos [B, 3, F, H, W] (or images [B, 3, H, W], one frame) in [-1, 1] -> normalised latents
        [B, C, f, h, w] (the posterior mean)."""
        vae = pipe.vae
        video = pixels if pixels.dim() == 5 else pixels[:, :, None]
        z = vae.encode(video.to(vae.dtype)).latent_dist.mean
        mean, std = self._stats(vae, z)
        return (z - mean) / std

    def decode_latents(self, pipe: Any, latents: Any) -> Any:
        """Latents [B, C, f, h, w] -> videos [B, 3, F, H, W] in [0, 1] (one frame: images [B, 3, H, W])."""
        vae = pipe.vae
        z = latents.to(vae.dtype)
        mean, std = self._stats(vae, z)
        video = vae.decode(z * std + mean, return_dict=False)[0]
        video = (video.float() / 2 + 0.5).clamp(0, 1)
        return video[:, :, 0] if video.shape[2] == 1 else video

    # ---- validation -------------------------------------------------------------------------------
    def check_settings(self, res: Any, job: Any) -> None:
        super().check_settings(res, job)
        # the low-noise expert samples with CFG in every job that samples (a rollout, an evaluation); SFT's
        # training forward runs without CFG
        samples = job.generates or bool(res["eval_prompt_data"]) or bool(res["eval_config"])
        cfg = float(res["diffusion_guidance_scale"]) > 1.0
        if cfg and samples and res["diffusion_guidance_scale_2"] is None:
            res.fail(
                "--diffusion-guidance-scale-2 is required for wan2_2 (the low-noise expert transformer_2's CFG "
                f"scale; {res.show('diffusion_guidance_scale')} is the high-noise expert's)"
            )
        if not cfg and res["diffusion_guidance_scale_2"] is not None and float(res["diffusion_guidance_scale_2"]) > 1:
            res.fail(
                f"{res.show('diffusion_guidance_scale_2')}: wan2_2 runs CFG only when --diffusion-guidance-scale "
                "is > 1 (as WanPipeline), so the low-noise scale would be ignored"
            )
        if job.distills:
            targets = res["update_weight_target_module"]
            parts = targets if isinstance(targets, (list, tuple)) else str(targets or "transformer").split(",")
            if set(EXPERTS) - {str(p).strip() for p in parts}:
                res.fail(
                    f"{res.show('update_weight_target_module')}: `miles {job.command}` with wan2_2 trains a student "
                    "whose timesteps cross the expert boundary, so it needs both experts (use "
                    "--update-weight-target-module transformer,transformer_2)"
                )

    # ---- sglang-diffusion adapter (`--rollout-backend sglang`; torch only when called) ------------
    # sglang 0.5.23 serves Wan2.2 with its native pipeline (`--model-id`, `sglang_model_id`); its port of the
    # DiT names the parameters its own way (`sglang_module`) and wraps no LoRA layer of the embedders
    sglang_cpu_blocker = (
        "its Wan DiT's LayerNormScaleShift norms call sgl_kernel's fused_norm_scale_shift_cpu op, absent from "
        "sglang's CPU build"
    )
    sglang_text_length: ClassVar[int] = 512  # sglang pads Wan's UMT5 states to this many tokens, always
    sglang_lora_excluded: ClassVar[tuple[str, ...]] = ("embedder",)  # sglang's `exclude_lora_layers` for Wan

    def sglang_blocker(self, guidance_scale: float, true_cfg_scale: float | None, max_sequence_length: int) -> str:
        """sglang zero-pads Wan's text states to 512 tokens whatever the request's `max_sequence_length`;
        `WanPipeline` pads them to the checkpoint's length, and the DiT's cross-attention sees the padding
        (its text projection maps zero rows to its bias), so at any other length neither branch is the
        pipeline's."""
        if max_sequence_length == self.sglang_text_length:
            return ""
        return (
            f"sglang pads Wan's UMT5 states to {self.sglang_text_length} tokens whatever the request says, and this "
            f"checkpoint's text length is {max_sequence_length}, so its cross-attention (both branches) would not "
            "be WanPipeline's"
        )

    def sglang_sampling_params(self, max_sequence_length: int) -> dict[str, Any]:
        """Tokenize at the checkpoint's text length (sglang truncates there; it pads to 512 regardless)."""
        return {"max_sequence_length": int(max_sequence_length)}

    def from_engine_latents(self, latents: Any, height: int, width: int) -> Any:
        """sglang steps Wan's latents unpacked: `[T+1, C, f, h, w]` already (refused otherwise)."""
        if latents.dim() != 5:
            raise ValueError(
                f"sglang returned Wan trajectory latents of shape {tuple(latents.shape)}; expected "
                "[T+1, C, frames, h, w]"
            )
        return latents.float()

    def from_engine_image(self, image: Any) -> Any:
        """sglang's Wan output is a video `[3, F, H, W]` in [0, 1]; one frame is an image `[3, H, W]`, as
        `decode_latents` gives it."""
        image = image.float()
        if image.dim() == 4 and image.shape[1] == 1:
            return image[:, 0]
        return image

    def from_engine_conditions(
        self, cond_kwargs: Mapping[str, Any], env: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """The UMT5 states `[L, D]` (sglang's length, zero-padded) and nothing else the env holds."""
        rows = super().from_engine_conditions(cond_kwargs, env)
        missing = [k for k in self.condition_inputs if k not in rows]
        if missing:
            raise ValueError(f"sglang's Wan denoising_env has no {missing} (keys: {sorted(cond_kwargs)})")
        return {k: rows[k] for k in self.condition_inputs}

    def engine_module(self, module: str) -> tuple[str, list[str]]:
        """One expert's module -> the name sglang's Wan DiT gives it (itself its only member)."""
        return sglang_module(module), [module]

    def to_engine_tensors(self, tensors: Mapping[str, Any]) -> dict[str, Any]:
        """One expert's named tensors under sglang's names (nothing is fused; the names differ)."""
        out: dict[str, Any] = {}
        for name, tensor in tensors.items():
            module, dot, leaf = name.rpartition(".")
            out[f"{sglang_module(module)}{dot}{leaf}" if module else name] = tensor
        return out


# the module renames of sglang's port of the Wan DiT (a diffusers module suffix -> sglang's), per block first
_SGLANG_BLOCK_RENAMES = (
    ("attn1.to_out.0", "to_out"),
    ("attn1.to_q", "to_q"),
    ("attn1.to_k", "to_k"),
    ("attn1.to_v", "to_v"),
    ("attn1.norm_q", "norm_q"),
    ("attn1.norm_k", "norm_k"),
    ("attn2.to_out.0", "attn2.to_out"),
    ("ffn.net.0.proj", "ffn.fc_in"),
    ("ffn.net.2", "ffn.fc_out"),
    ("norm2", "self_attn_residual_norm.norm"),
)
_SGLANG_TOP_RENAMES = {
    "patch_embedding": "patch_embedding.proj",
    "condition_embedder.time_embedder.linear_1": "condition_embedder.time_embedder.mlp.fc_in",
    "condition_embedder.time_embedder.linear_2": "condition_embedder.time_embedder.mlp.fc_out",
    "condition_embedder.time_proj": "condition_embedder.time_modulation.linear",
    "condition_embedder.text_embedder.linear_1": "condition_embedder.text_embedder.fc_in",
    "condition_embedder.text_embedder.linear_2": "condition_embedder.text_embedder.fc_out",
}


def sglang_module(module: str) -> str:
    """A module of one Wan expert (diffusers' name, e.g. `blocks.3.attn1.to_q`) -> the name sglang 0.5.23's
    Wan DiT gives it (`blocks.3.to_q`); other modules keep their names."""
    if module in _SGLANG_TOP_RENAMES:
        return _SGLANG_TOP_RENAMES[module]
    head, _, rest = module.partition(".")
    index, _, inner = rest.partition(".")
    if head == "blocks" and index.isdigit():
        for old, new in _SGLANG_BLOCK_RENAMES:
            if inner == old:
                return f"blocks.{index}.{new}"
    return module


def _boundary_config(checkpoint: Any, default_ratio: float = 0.875) -> tuple[float | None, int]:
    """(`boundary_ratio` of model_index.json, the scheduler's `num_train_timesteps`) of a local checkpoint;
    (`default_ratio`, 1000) when the files are not here (Wan2.2-T2V-A14B's 0.875 by default)."""
    root = os.fspath(checkpoint)
    ratio: float | None = default_ratio
    steps = 1000
    try:
        with open(os.path.join(root, "model_index.json")) as f:
            ratio = json.load(f).get("boundary_ratio", ratio)
    except (OSError, ValueError):
        pass
    try:
        with open(os.path.join(root, "scheduler", "scheduler_config.json")) as f:
            steps = int(json.load(f).get("num_train_timesteps", steps))
    except (OSError, ValueError):
        pass
    return ratio, steps
