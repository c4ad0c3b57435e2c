"""The `sd3` family: Stable Diffusion 3 / 3.5 (and the embedded `tiny-sd3`), one MM-DiT `transformer`.

Torch-free at import. The DiT forward takes `encoder_hidden_states` (CLIP-L + CLIP-G + T5 tokens,
joint_attention_dim wide) and `pooled_projections` (the two CLIP pooled outputs), and the timestep
in [0, 1000] as the scheduler gives it.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

from miles.models.families import register_train_pipeline_config
from miles.models.pipeline_config import TrainPipelineConfig

SD3_LORA_TARGET_MODULES: tuple[str, ...] = (
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
)


@register_train_pipeline_config("sd3")
class SD3TrainPipelineConfig(TrainPipelineConfig):
    description = "Stable Diffusion 3 / 3.5 (MM-DiT) text-to-image, incl. the embedded tiny-sd3"
    hf_ckpt_name_patterns = ("stable-diffusion-3", "sd3", "tiny-sd3")
    pipeline_class = "diffusers.StableDiffusion3Pipeline"
    transformer_class = "diffusers.SD3Transformer2DModel"
    lora_target_modules = SD3_LORA_TARGET_MODULES
    condition_inputs = ("encoder_hidden_states", "pooled_projections")
    weight_sync_targets = ("transformer",)
    trainable = True
    supports_cfg_training = True
    cfg_batching = True
    input_dtype_policy = MappingProxyType({"latents": "default", "cond": "default", "timestep": None})

    sglang_model_id = "stable-diffusion-3-medium-diffusers"
    sglang_text_encoders = 3  # CLIP-L, CLIP-G, T5

    # ---- engine hooks: prompt encoding (imports torch only when called); the VAE side is the base's ----
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
        """Positive (and, under CFG, negative) condition dicts, batched over `prompts` (SD3 has no
        embedded guidance: `guidance` is unused)."""
        negative = [negative_prompt if negative_prompt is not None else " "] * len(prompts) if do_cfg else None
        pos, neg, pooled, neg_pooled = pipe.encode_prompt(
            prompt=prompts,
            prompt_2=prompts,
            prompt_3=prompts,
            device=pipe._execution_device,
            do_classifier_free_guidance=do_cfg,
            negative_prompt=negative,
            negative_prompt_2=negative,
            negative_prompt_3=negative,
            max_sequence_length=max_sequence_length,
        )
        positive = {"encoder_hidden_states": pos, "pooled_projections": pooled}
        if not do_cfg:
            return positive, None
        return positive, {"encoder_hidden_states": neg, "pooled_projections": neg_pooled}

    def example_conditions(self, configs: Any, text_length: int) -> dict[str, Any]:
        """CLIP-L and CLIP-G tokens (their position count, 77) then `text_length` T5 tokens, all
        `joint_attention_dim` wide; the two CLIP pooled outputs, `pooled_projection_dim` wide."""
        transformer = configs["transformer"]
        clip = int(configs.get("text_encoder", {}).get("max_position_embeddings", 77))
        return {
            "encoder_hidden_states": ((clip + int(text_length), int(transformer["joint_attention_dim"])), None),
            "pooled_projections": ((int(transformer["pooled_projection_dim"]),), None),
        }

    # ---- training-side parallelism (miles.models.sd3.parallel: diffusers' SD3 processor has neither) ----
    def enable_sequence_parallel(self, model: Any, group: Any) -> None:
        """Ulysses over `group`: image tokens split after the patch embedding, gathered after `proj_out`."""
        from miles.models.sd3.parallel import enable_sequence_parallel

        enable_sequence_parallel(model, group)

    def set_attention_backend(self, model: Any, backend: str) -> None:
        """miles' joint-attention processor, dispatching to `backend` through `dispatch_attention_fn`."""
        from miles.models.sd3.parallel import set_attention_backend

        set_attention_backend(model, backend)
