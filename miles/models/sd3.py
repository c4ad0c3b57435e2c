"""The `sd3` family: Stable Diffusion 3 / 3.5 (and the embedded `tiny-sd3`), one MM-DiT `transformer`.

Torch-free at import. The DiT forward takes `encoder_hidden_states` (CLIP-L + CLIP-G + T5 tokens,
joint_attention_dim wide) and `pooled_projections` (the two CLIP pooled outputs), and the timestep
in [0, 1000] as the scheduler gives it.
"""

from __future__ import annotations

from types import MappingProxyType

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
