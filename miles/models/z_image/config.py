"""The `z_image` family: Z-Image (base and Turbo) and the embedded `tiny-z-image`, one single-stream DiT.

Torch-free at import. What sets it apart, all inside this config:
  * the DiT takes lists: one `[C, 1, h, w]` latent and one unpadded text sequence per sample (it patchifies,
    pads and masks inside); miles keeps natural `[B, C, h, w]` latents and a padded text batch with its mask
    (`collate_conditions`), and cuts each row's padding off before the forward (a padded caption changes the
    output);
  * the text is Qwen3's second-to-last hidden state of the chat-templated prompt (`enable_thinking=True`: no
    think block), its padding dropped;
  * the DiT is fed `1 - sigma` (`(1000 - t) / 1000`) and predicts the negated velocity;
  * CFG is on for any guidance scale above 0: `pos + s * (pos - neg)` (standard CFG at `1 + s`), the negative the
    empty prompt; the pipeline's optional CFG renormalisation and truncation are off (their defaults);
  * the schedule is a static shift over `linspace(1, 1/n, n)` (3 for Turbo, 6 for the base model).
"""

from __future__ import annotations

from typing import Any

from miles.models.families import register_train_pipeline_config
from miles.models.pipeline_config import TrainPipelineConfig
from miles.models.qwen_image.config import QwenImageTrainPipelineConfig

# the attention and SwiGLU linears of every block (the main layers and both refiners)
Z_IMAGE_LORA_TARGET_MODULES: tuple[str, ...] = (
    "attention.to_q",
    "attention.to_k",
    "attention.to_v",
    "attention.to_out.0",
    "feed_forward.w1",
    "feed_forward.w2",
    "feed_forward.w3",
)
EMPTY_NEGATIVE = ""  # ZImagePipeline's negative prompt when none is given


@register_train_pipeline_config("z_image")
class ZImageTrainPipelineConfig(TrainPipelineConfig):
    description = (
        "Z-Image text-to-image (single-stream DiT over Qwen3 hidden states, 1 - sigma in, negated velocity out), "
        "incl. the embedded tiny-z-image"
    )
    hf_ckpt_name_patterns = ("z-image", "z_image", "zimage", "tiny-z-image")
    pipeline_class = "diffusers.ZImagePipeline"
    transformer_class = "diffusers.ZImageTransformer2DModel"
    lora_target_modules = Z_IMAGE_LORA_TARGET_MODULES
    condition_inputs = ("encoder_hidden_states", "encoder_hidden_states_mask")
    weight_sync_targets = ("transformer",)
    supports_cfg_training = True
    cfg_batching = False  # positive and negative texts differ in length: two forwards
    fsdp_block_lists = ("noise_refiner", "context_refiner", "layers")  # Z-Image: 2 + 2 refiners, 30 layers
    guidance_mode = "cfg"
    pipeline_sigmas = True
    packs_latents = True  # the DiT patchifies 2x2 itself: h, w even (the output a multiple of 16)
    max_sequence_length = 512
    sde_timestep_divisor = 1000.0
    sglang_unserved = (
        "miles' sglang adapter for Z-Image is not built: sglang-diffusion has a Z-Image pipeline, but its rollout "
        "trajectories are not verified against miles' recompute; the in-process engine serves it"
    )
    comfyui_lora = False
    comfyui_lora_missing = "miles does not map Z-Image's module names to ComfyUI's yet"

    # ---- schedule --------------------------------------------------------------------------------
    def sigma_grid(self, num_steps: int) -> Any:
        """`torch.linspace(1, 1/n, n)` in float32, as `get_default_z_image_sigmas` makes it, torch-free: torch's CPU
        kernel takes each value as one fused multiply-add of the float32 step, from the start for the first half
        and from the end for the rest (a float64 linspace differs from it in the last bit)."""
        import numpy as np

        start, end = np.float32(1.0), np.float32(1.0 / num_steps)
        if num_steps == 1:
            return np.array([start], dtype=np.float32)
        step = (end - start) / np.float32(num_steps - 1)
        half = num_steps // 2
        values = [
            float(start) + float(step) * i if i < half else float(end) - float(step) * (num_steps - i - 1)
            for i in range(num_steps)
        ]  # a float32 product of an integer below 2**24 is exact in float64: one rounding, as the FMA's
        return np.array(values).astype(np.float32)

    # ---- guidance ----------------------------------------------------------------------------------
    def cfg_scale(self, guidance_scale: float, true_cfg_scale: float | None = None) -> float:
        """Z-Image's `pos + s (pos - neg)` is standard CFG at `1 + s`; scale 0 (Turbo) is one branch."""
        scale = float(guidance_scale)
        return 1.0 + scale if scale > 0 else 1.0

    def cfg_combine(self, pos: Any, neg: Any, scale: Any) -> Any:
        """`pos + s (pos - neg)` with `s = scale - 1`, the pipeline's own arithmetic."""
        return pos + (scale - 1.0) * (pos - neg)

    # ---- text --------------------------------------------------------------------------------------
    def example_conditions(self, configs: Any, text_length: int) -> dict[str, Any]:
        """`text_length` Qwen3 states `cap_feat_dim` wide; the mask all ones."""
        width = int(configs["transformer"]["cap_feat_dim"])
        return {"encoder_hidden_states": ((int(text_length), width), None), "encoder_hidden_states_mask": (None, None)}

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
        """Each prompt's unpadded Qwen3 states (the pipeline's `encode_prompt`), padded to the batch's longest with
        a mask; the negative branch encodes the empty prompt unless `--diffusion-negative-prompt` says otherwise."""

        def encode(texts: list[str]) -> dict[str, Any]:
            # the pipeline writes the templated text back into the list it is given: pass a copy
            states, _ = pipe.encode_prompt(
                prompt=list(texts),
                device=pipe._execution_device,
                do_classifier_free_guidance=False,
                max_sequence_length=max_sequence_length,
            )
            rows = [{"encoder_hidden_states": s, "encoder_hidden_states_mask": s.new_ones(s.shape[0])} for s in states]
            return self.collate_conditions(rows)

        positive = encode(prompts)
        if not do_cfg:
            return positive, None
        negative = EMPTY_NEGATIVE if negative_prompt is None else negative_prompt
        return positive, encode([negative] * len(prompts))

    # rows of different text lengths: padded with a zero mask, and cut back per row, as qwen_image's
    collate_conditions = QwenImageTrainPipelineConfig.collate_conditions
    condition_row = QwenImageTrainPipelineConfig.condition_row

    # ---- the forward -------------------------------------------------------------------------------
    def forward_velocity(self, transformer: Any, latents: Any, timestep: Any, cond: Any) -> Any:
        """One latent and one unpadded caption per sample into the DiT, `1 - sigma` in; the negated output."""
        import torch

        text, mask = cond["encoder_hidden_states"], cond["encoder_hidden_states_mask"]
        lengths = [int(text.shape[1])] * int(text.shape[0]) if mask is None else [int(m.sum()) for m in mask]
        captions = [text[b, :n] for b, n in enumerate(lengths)]
        t = (1000 - timestep.to(latents.dtype)) / 1000
        out = transformer(list(latents.unsqueeze(2).unbind(dim=0)), t, captions, return_dict=False)[0]
        return -torch.stack([o.float() for o in out], dim=0).squeeze(2)
