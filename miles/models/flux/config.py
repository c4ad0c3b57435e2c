"""The `flux` family: FLUX.1 (dev / schnell) and the embedded `tiny-flux`, one MM-DiT `transformer`.

Torch-free at import. What differs from SD3, all inside this config:
  * the DiT takes 2x2-packed latent tokens `[B, h*w/4, 4C]` plus RoPE positions (`img_ids` from the latent
    grid, `txt_ids` zeros): latents stay `[B, C, h, w]` everywhere else, packed and unpacked here, so the
    element-mean log-prob is unchanged (packing is a permutation);
  * guidance is a model input (`guidance`, FLUX.1-dev is guidance-distilled): `--diffusion-guidance-scale`
    is that input, carried as a condition; real CFG with a negative branch only under
    `--diffusion-true-cfg-scale > 1` (two forwards, no rescale), as `FluxPipeline` does;
  * the timestep enters as t/1000; the scheduler shifts dynamically with the image token count.
"""

from __future__ import annotations

from typing import Any

from miles.models.families import register_train_pipeline_config
from miles.models.pipeline_config import TrainPipelineConfig

FLUX_LORA_TARGET_MODULES: tuple[str, ...] = (
    # double-stream blocks: image and text attention, image and text FFNs
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "ff.net.0.proj",
    "ff.net.2",
    "ff_context.net.0.proj",
    "ff_context.net.2",
    # single-stream blocks: the fused MLP in and the joint output projection
    "proj_mlp",
    "proj_out",
)


def pack_latents(latents: Any) -> Any:
    """[B, C, h, w] -> [B, (h/2)(w/2), 4C]: each 2x2 latent patch becomes one token (FluxPipeline's order)."""
    b, c, h, w = latents.shape
    x = latents.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(tokens: Any, height: int, width: int) -> Any:
    """The inverse of `pack_latents`: [B, (h/2)(w/2), 4C] -> [B, C, h, w] for a latent of h x w."""
    b, _, d = tokens.shape
    x = tokens.reshape(b, height // 2, width // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, d // 4, height, width)


def unpack_engine_latents(latents: Any, height: int, width: int) -> Any:
    """sglang's packed trajectory `[T+1, (h/2)(w/2), 4C]` of an image `height` x `width` -> `[T+1, C, h, w]`.

    sglang packs a latent grid of `2 * (H // 2f)` x `2 * (W // 2f)` for its VAE factor f; f is the one
    whose grid has the trajectory's token count (latents that are not 3-d are returned as they are)."""
    if latents.dim() != 3:
        return latents.float()
    tokens = int(latents.shape[1])
    for factor in range(1, 65):
        h, w = 2 * (height // (2 * factor)), 2 * (width // (2 * factor))
        if h and w and (h // 2) * (w // 2) == tokens:
            return unpack_latents(latents.float(), h, w)
    raise ValueError(f"engine latents {tuple(latents.shape)} fit no 2x2-packed grid of a {height}x{width} image")


def latent_image_ids(h: int, w: int, device: Any, dtype: Any) -> Any:
    """RoPE positions of the packed image tokens: [(h/2)(w/2), 3] = (0, row, col)."""
    import torch

    ids = torch.zeros(h // 2, w // 2, 3)
    ids[..., 1] = torch.arange(h // 2)[:, None]
    ids[..., 2] = torch.arange(w // 2)[None, :]
    return ids.reshape(-1, 3).to(device=device, dtype=dtype)


SGLANG_NEGATIVE_TEXT_LENGTH = 512  # sglang's T5 text_len, which its negative-prompt encoding always uses


@register_train_pipeline_config("flux")
class FluxTrainPipelineConfig(TrainPipelineConfig):
    description = "FLUX.1 text-to-image (MM-DiT, packed 2x2 latents, embedded guidance), incl. the embedded tiny-flux"
    hf_ckpt_name_patterns = ("flux.1", "flux", "tiny-flux")
    pipeline_class = "diffusers.FluxPipeline"
    transformer_class = "diffusers.FluxTransformer2DModel"
    lora_target_modules = FLUX_LORA_TARGET_MODULES
    condition_inputs = ("encoder_hidden_states", "pooled_projections", "guidance")
    weight_sync_targets = ("transformer",)
    trainable = True
    supports_cfg_training = True
    cfg_batching = False  # FluxPipeline runs its true-CFG negative branch as a second forward
    fsdp_block_lists = ("transformer_blocks", "single_transformer_blocks")  # FLUX.1-dev: 19 double + 38 single
    guidance_mode = "embedded"
    pipeline_sigmas = True
    max_sequence_length = 512
    packs_latents = True
    sde_timestep_divisor = 1000.0
    sglang_model_id = "FLUX.1-dev"
    sglang_text_encoders = 2  # CLIP-L (pooled), T5

    def latent_channels(self, pipe: Any) -> int:
        return int(pipe.transformer.config.in_channels) // 4

    def example_conditions(self, configs: Any, text_length: int) -> dict[str, Any]:
        """`text_length` T5 tokens `joint_attention_dim` wide, the pooled CLIP `pooled_projection_dim` wide, and the
        embedded guidance value (a float32 scalar per sample)."""
        transformer = configs["transformer"]
        return {
            "encoder_hidden_states": ((int(text_length), int(transformer["joint_attention_dim"])), None),
            "pooled_projections": ((int(transformer["pooled_projection_dim"]),), None),
            "guidance": ((), "float32"),
        }

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
        """T5 tokens + pooled CLIP per prompt, and the embedded guidance value as a `[B]` condition."""
        import torch

        def encode(texts: list[str]) -> dict[str, Any]:
            embeds, pooled, _ = pipe.encode_prompt(
                prompt=texts, prompt_2=texts, device=pipe._execution_device, max_sequence_length=max_sequence_length
            )
            value = 0.0 if guidance is None else float(guidance)
            return {
                "encoder_hidden_states": embeds,
                "pooled_projections": pooled,
                "guidance": torch.full((len(texts),), value, dtype=torch.float32, device=embeds.device),
            }

        positive = encode(prompts)
        if not do_cfg:
            return positive, None
        return positive, encode([negative_prompt if negative_prompt is not None else " "] * len(prompts))

    def forward_velocity(self, transformer: Any, latents: Any, timestep: Any, cond: dict[str, Any]) -> Any:
        """Pack, run the DiT with image/text RoPE ids and t/1000, unpack to [B, C, h, w]."""
        import torch

        h, w = int(latents.shape[-2]), int(latents.shape[-1])
        text = cond["encoder_hidden_states"]
        guidance = cond.get("guidance") if transformer.config.guidance_embeds else None
        out = transformer(
            hidden_states=pack_latents(latents),
            timestep=timestep.to(latents.dtype) / 1000,
            guidance=None if guidance is None else guidance.to(torch.float32),
            pooled_projections=cond["pooled_projections"],
            encoder_hidden_states=text,
            txt_ids=torch.zeros(text.shape[1], 3, device=text.device, dtype=text.dtype),
            img_ids=latent_image_ids(h, w, latents.device, latents.dtype),
            return_dict=False,
        )[0]
        return unpack_latents(out, h, w)

    # ---- sglang adapter --------------------------------------------------------------------------
    def sglang_blocker(self, guidance_scale: float, true_cfg_scale: float | None, max_sequence_length: int) -> str:
        """sglang (0.5.23) encodes the negative prompt at its T5 config's 512 tokens whatever the request's
        `max_sequence_length`; `FluxPipeline` pads both branches to the same length. With a negative branch
        (true CFG) and another text length, sglang's guided velocity is not the pipeline's."""
        if self.cfg_scale(guidance_scale, true_cfg_scale) <= 1.0 or max_sequence_length == SGLANG_NEGATIVE_TEXT_LENGTH:
            return ""
        return (
            f"sglang encodes FLUX's negative prompt at {SGLANG_NEGATIVE_TEXT_LENGTH} T5 tokens whatever the request "
            f"says, and this checkpoint's text length is {max_sequence_length}, so its true-CFG negative branch "
            "would not be FluxPipeline's"
        )

    def sglang_sampling_params(self, max_sequence_length: int) -> dict[str, Any]:
        """T5 at the checkpoint's length, as `FluxPipeline` pads it (sglang pads to 512 otherwise; it keeps
        CLIP at its fixed 77 tokens whatever the request says)."""
        return {"max_sequence_length": int(max_sequence_length)}

    def from_engine_conditions(self, cond_kwargs: Any, env: Any = None) -> dict[str, Any]:
        """The T5 tokens and pooled CLIP of the env, plus `guidance` from `env["guidance"]`: sglang builds it
        from the server's `--embedded-cfg-scale` times 1000 (its DiT takes it pre-scaled, diffusers' scales it
        inside), so it is divided back to the value `encode_prompts` stores, a 0-d float32."""
        rows = super().from_engine_conditions(cond_kwargs, env)
        guidance = (env or {}).get("guidance")
        if guidance is not None:
            rows["guidance"] = guidance.float().reshape(-1)[0] / 1000.0
        return rows

    def from_engine_latents(self, latents: Any, height: int, width: int) -> Any:
        return unpack_engine_latents(latents, height, width)
