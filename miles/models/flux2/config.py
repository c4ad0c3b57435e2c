"""The `flux2` family: FLUX.2-klein (4B / 9B, base and distilled) and the embedded `tiny-flux2-klein`.

Torch-free at import. What sets it apart, all inside this config:
  * the state the sampler steps is the VAE latent patchified 2x2 into channels (`[B, 4z, H/16, W/16]`, channel
    `c * 4 + dy * 2 + dx`) and normalised per channel by the VAE's batch-norm running statistics
    (`(x - mean) / sqrt(var + eps)`); miles keeps it in that natural layout and flattens it to tokens
    (`[B, h*w, 4z]`, row-major) only inside the forward, so noise drawn per sample is the pipeline's;
  * the text condition is three hidden states of a Qwen3 language model (layers 9, 18 and 27 by default),
    concatenated per token (`joint_attention_dim` = 3 x its width), padded to the text length, with no mask in
    the DiT; RoPE ids have four axes (T, H, W, L): text `(0, 0, 0, l)`, image `(0, r, c, 0)`;
  * the DiT takes sigma (the timestep / 1000); no guidance input. The base models run CFG as two forwards,
    `neg + s * (pos - neg)`, with the empty prompt as the negative; the distilled ones (`is_distilled` in the
    checkpoint's `model_index.json`) take no guidance, so a scale above 1 is refused on them;
  * the schedule's shift `mu` is FLUX.2's empirical fit in the token count and the number of steps.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from miles.models.families import register_train_pipeline_config
from miles.models.pipeline_config import TrainPipelineConfig

# the Flux2Transformer2DModel linears per block. The single blocks' output projection (`attn.to_out`, a Linear
# there) is left out: the same suffix names the double blocks' `attn.to_out` ModuleList, which peft cannot wrap
FLUX2_LORA_TARGET_MODULES: tuple[str, ...] = (
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "ff.linear_in",
    "ff.linear_out",
    "ff_context.linear_in",
    "ff_context.linear_out",
    "attn.to_qkv_mlp_proj",
)

# Flux2KleinPipeline's default hidden states (of a 36-layer Qwen3; tiny-flux2-klein's encoder has 28 layers so
# that the same three are inner layers there too)
TEXT_ENCODER_OUT_LAYERS = (9, 18, 27)
EMPTY_NEGATIVE = ""  # the pipeline's negative prompt, always


def empirical_mu(image_seq_len: int, num_steps: int) -> float:
    """FLUX.2's shift `mu` for `image_seq_len` image tokens and `num_steps` steps: above 4,300 tokens the 200-step
    line in the token count; below it, linear in the step count between the 10-step and the 200-step lines."""
    slope_200, offset_200 = 0.00016927, 0.45666666
    slope_10, offset_10 = 8.73809524e-05, 1.89833333
    at_200 = slope_200 * image_seq_len + offset_200
    if image_seq_len > 4300:
        return float(at_200)
    at_10 = slope_10 * image_seq_len + offset_10
    per_step = (at_200 - at_10) / 190.0
    return float(per_step * num_steps + at_200 - 200.0 * per_step)


def to_tokens(latents: Any) -> Any:
    """[B, C, h, w] -> [B, h*w, C] (row-major tokens, as the pipeline packs)."""
    return latents.flatten(2).transpose(1, 2)


def from_tokens(tokens: Any, height: int, width: int) -> Any:
    """The inverse of `to_tokens` for a grid of `height` x `width` tokens."""
    return tokens.transpose(1, 2).reshape(tokens.shape[0], tokens.shape[2], height, width)


def patchify(z: Any) -> Any:
    """VAE latents [B, z, H, W] -> [B, 4z, H/2, W/2] (channel c * 4 + dy * 2 + dx)."""
    b, c, h, w = z.shape
    return z.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4).reshape(b, c * 4, h // 2, w // 2)


def unpatchify(x: Any) -> Any:
    """The inverse of `patchify`."""
    b, c, h, w = x.shape
    return x.reshape(b, c // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3).reshape(b, c // 4, h * 2, w * 2)


def bn_stats(vae: Any, like: Any) -> tuple[Any, Any]:
    """The VAE's batch-norm running mean and std (`sqrt(var + eps)`) as [1, 4z, 1, 1] in `like`'s dtype."""
    mean = vae.bn.running_mean.view(1, -1, 1, 1).to(like.device, like.dtype)
    std = (vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).sqrt().to(like.device, like.dtype)
    return mean, std


def ids_grid(height: int, width: int, device: Any) -> Any:
    """RoPE ids of a generated image's tokens: [h*w, 4] = (0, row, col, 0), int64 as the pipeline makes them (a bf16
    id would round positions above 256)."""
    import torch

    ids = torch.zeros(height, width, 4, dtype=torch.long)
    ids[..., 1] = torch.arange(height)[:, None]
    ids[..., 2] = torch.arange(width)[None, :]
    return ids.reshape(-1, 4).to(device)


def text_ids(length: int, device: Any) -> Any:
    """RoPE ids of the text tokens: [L, 4] = (0, 0, 0, l), int64 (512 text positions are not exact in bf16)."""
    import torch

    ids = torch.zeros(length, 4, dtype=torch.long)
    ids[:, 3] = torch.arange(length)
    return ids.to(device)


def is_distilled(checkpoint: Any) -> bool:
    """Whether `checkpoint` is a distilled klein: `is_distilled` of its `model_index.json` (a local folder, or the
    Hugging Face cache's snapshot of a hub id), else BFL's naming (`FLUX.2-klein-4B` / `-9B` are the distilled
    models, `FLUX.2-klein-base-*` the base ones); any other name counts as base (the pipeline's default; the tiny
    build is a base model)."""
    from miles.models.hub_cache import cached_snapshot, looks_like_hub_id

    folder = Path(str(checkpoint))
    if not folder.is_dir() and looks_like_hub_id(str(checkpoint)):
        folder = cached_snapshot(str(checkpoint)) or folder
    index = folder / "model_index.json"
    if index.is_file():
        try:
            return bool(json.loads(index.read_text()).get("is_distilled", False))
        except (OSError, ValueError):
            return False
    name = folder.name.lower()
    return name.startswith("flux.2-klein-") and "base" not in name


@register_train_pipeline_config("flux2")
class Flux2TrainPipelineConfig(TrainPipelineConfig):
    description = (
        "FLUX.2-klein text-to-image (MM-DiT over a Qwen3 text encoder, batch-norm normalised 2x2-patchified "
        "latents, CFG on the base models), incl. the embedded tiny-flux2-klein"
    )
    hf_ckpt_name_patterns = ("flux.2", "flux2", "klein", "tiny-flux2")
    pipeline_class = "diffusers.Flux2KleinPipeline"
    transformer_class = "diffusers.Flux2Transformer2DModel"
    lora_target_modules = FLUX2_LORA_TARGET_MODULES
    condition_inputs = ("encoder_hidden_states",)
    weight_sync_targets = ("transformer",)
    supports_cfg_training = True
    cfg_batching = False  # Flux2KleinPipeline runs the negative branch as a second forward
    fsdp_block_lists = ("transformer_blocks", "single_transformer_blocks")  # klein-4B: 5 double + 20 single
    guidance_mode = "cfg"
    pipeline_sigmas = True
    latent_patch = 1  # the state is already patchified: one token per latent cell
    max_sequence_length = 512
    sde_timestep_divisor = 1000.0
    sglang_unserved = (
        "miles' sglang adapter for FLUX.2-klein is not built: sglang-diffusion has a klein pipeline, but its "
        "rollout trajectories are not verified against miles' recompute; the in-process engine serves it"
    )
    comfyui_lora = False
    comfyui_lora_missing = "miles does not map FLUX.2's module names to ComfyUI's yet"

    # ---- the checkpoint: distilled or base ---------------------------------------------------------
    def check_settings(self, res: Any, job: Any) -> None:
        super().check_settings(res, job)
        checkpoint = res["hf_checkpoint"]
        scale = float(res["diffusion_guidance_scale"])
        if checkpoint is not None and scale > 1.0 and is_distilled(checkpoint):
            res.fail(
                f"{res.show('diffusion_guidance_scale')}: {checkpoint} is a distilled FLUX.2-klein (its "
                "model_index.json's is_distilled, or BFL's name without -base), which takes no guidance; set 1, or "
                "train a base klein (FLUX.2-klein-base-4B / -9B) with CFG"
            )

    # ---- schedule --------------------------------------------------------------------------------
    def shift_mu(self, image_seq_len: int, num_steps: int, config: Any) -> float:
        return empirical_mu(image_seq_len, num_steps)

    # ---- latents ---------------------------------------------------------------------------------
    def latent_channels(self, pipe: Any) -> int:
        return int(pipe.transformer.config.in_channels)

    def latent_shape(self, pipe: Any, height: int, width: int, num_frames: int = 1) -> tuple[int, ...]:
        """(4z, H/16, W/16): the patchified, normalised latent the pipeline draws its noise in."""
        if num_frames != 1:
            raise ValueError(
                f"--diffusion-output-num-frames {num_frames}: model family {self.name!r} makes images (use 1)"
            )
        factor = int(pipe.vae_scale_factor) * 2
        if height % factor or width % factor:
            raise ValueError(
                f"--diffusion-height/--diffusion-width must be multiples of {factor} for model family "
                f"{self.name!r}, got {height}x{width}"
            )
        return (self.latent_channels(pipe), height // factor, width // factor)

    def encode_images(self, pipe: Any, pixels: Any) -> Any:
        """Images [B, 3, H, W] in [-1, 1] -> the normalised patchified latents (the posterior mode, as the pipeline
        encodes its reference images)."""
        vae = pipe.vae
        x = patchify(vae.encode(pixels.to(vae.dtype)).latent_dist.mode())
        mean, std = bn_stats(vae, x)
        return (x - mean) / std

    def decode_latents(self, pipe: Any, latents: Any) -> Any:
        vae = pipe.vae
        x = latents.to(vae.dtype)
        mean, std = bn_stats(vae, x)
        image = vae.decode(unpatchify(x * std + mean), return_dict=False)[0]
        return (image.float() / 2 + 0.5).clamp(0, 1)

    # ---- text --------------------------------------------------------------------------------------
    def example_conditions(self, configs: Any, text_length: int) -> dict[str, Any]:
        """`text_length` tokens, `joint_attention_dim` (= 3 Qwen3 hidden states) wide."""
        width = int(configs["transformer"]["joint_attention_dim"])
        return {"encoder_hidden_states": ((int(text_length), width), None)}

    def encode_prompts(
        self,
        pipe: Any,
        prompts: list[str],
        negative_prompt: str | None,
        do_cfg: bool,
        max_sequence_length: int,
        guidance: float | None = None,
        geometry: Any = None,
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """The Qwen3 hidden states per prompt (the pipeline's chat template, padded to `max_sequence_length`);
        the negative branch encodes the empty prompt unless `--diffusion-negative-prompt` says otherwise."""

        def encode(texts: list[str]) -> dict[str, Any]:
            embeds, _ = pipe.encode_prompt(
                prompt=list(texts),
                device=pipe._execution_device,
                max_sequence_length=max_sequence_length,
                text_encoder_out_layers=TEXT_ENCODER_OUT_LAYERS,
            )
            return {"encoder_hidden_states": embeds}

        positive = encode(prompts)
        if not do_cfg:
            return positive, None
        negative = EMPTY_NEGATIVE if negative_prompt is None else negative_prompt
        return positive, encode([negative] * len(prompts))

    # ---- the forward -------------------------------------------------------------------------------
    def forward_velocity(self, transformer: Any, latents: Any, timestep: Any, cond: Any) -> Any:
        """Tokens, RoPE ids and sigma in; the image tokens' velocity back in the latent layout."""
        h, w = int(latents.shape[-2]), int(latents.shape[-1])
        text = cond["encoder_hidden_states"]
        out = transformer(
            hidden_states=to_tokens(latents),
            timestep=timestep.to(latents.dtype) / 1000,
            guidance=None,
            encoder_hidden_states=text,
            txt_ids=text_ids(text.shape[1], text.device)[None].expand(text.shape[0], -1, -1),
            img_ids=ids_grid(h, w, latents.device)[None].expand(latents.shape[0], -1, -1),
            return_dict=False,
        )[0]
        return from_tokens(out[:, : h * w], h, w)
