"""Families registered for name resolution and validation, without a training path in miles yet.

Selecting one is a clear ConfigError at validation time (see `TrainPipelineConfig.check_trainable`).
Their attributes record what the public miles-diffusion docs say about each family, so a later
implementation starts from them.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

from miles.models.families import register_train_pipeline_config
from miles.models.pipeline_config import TrainPipelineConfig

_ATTN = ("to_q", "to_k", "to_v", "to_out.0")
_ADD_ATTN = ("add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")


@register_train_pipeline_config("ltx")
class LTXTrainPipelineConfig(TrainPipelineConfig):
    description = "LTX-2 text-to-video (audio-video DiT)"
    hf_ckpt_name_patterns = ("ltx",)
    pipeline_class = "diffusers.LTX2Pipeline"
    transformer_class = "diffusers.LTX2VideoTransformer3DModel"
    lora_target_modules = (*_ATTN, "net.0.proj", "net.2")
    condition_inputs = ("encoder_hidden_states", "encoder_attention_mask")
    supports_cfg_training = False
    sde_timestep_divisor = 1000.0
    optimizer_state_allowed_missing = ("audio",)
    input_dtype_policy = MappingProxyType({"latents": "default", "cond": "default", "timestep": None})
    trainable = False
    not_trainable_reason = "its native audio-video modeling is not implemented"

    def check_settings(self, res: Any, job: Any) -> None:
        super().check_settings(res, job)
        if res["diffusion_guidance_scale"] != 1.0:
            res.fail(f"{res.show('diffusion_guidance_scale')}: the ltx family trains unguided (use 1.0)")
        if res["diffusion_negative_prompt"] is not None:
            res.fail(f"{res.show('diffusion_negative_prompt')}: the ltx family takes no negative prompt")


@register_train_pipeline_config("cosmos3")
class Cosmos3TrainPipelineConfig(TrainPipelineConfig):
    description = "Cosmos3 (Edge / Nano / Super) text-to-image, mixture-of-transformers"
    hf_ckpt_name_patterns = ("cosmos",)
    pipeline_class = "diffusers.Cosmos3OmniPipeline"
    transformer_class = "diffusers.Cosmos3OmniTransformer"
    lora_target_modules = _ADD_ATTN
    condition_inputs = ("text_ids", "text_mask", "fps")
    cfg_batching = False
    input_dtype_policy = MappingProxyType({"latents": None, "cond": None, "timestep": "fp32"})
    trainable = False
    not_trainable_reason = "its packed single-sample forward is not implemented"
