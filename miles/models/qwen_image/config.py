"""The `qwen_image` family: Qwen-Image and the embedded `tiny-qwen-image`, one MM-DiT `transformer`.

Torch-free at import. What differs from SD3, all inside this config:
  * text: Qwen2.5-VL's last hidden states with the prompt template's first 34 tokens dropped, and a mask;
    prompts differ in length, so rows are padded to the batch's longest with the mask zero there
    (`collate_conditions`) and the mask is passed as None when it is all ones (as `QwenImagePipeline` does);
  * 2x2-packed latent tokens and `img_shapes`, built from the latent shape inside `forward_velocity`
    (latents stay `[B, C, h, w]`; the VAE's frame axis is added only to encode/decode);
  * true CFG: positive and negative as two forwards (their text lengths differ), combined and then
    rescaled per packed token to the positive prediction's norm, as diffusers and sglang do;
  * timestep t/1000; dynamic shift with a terminal sigma of 0.02.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from miles.models.families import register_train_pipeline_config
from miles.models.flux.config import pack_latents, unpack_engine_latents, unpack_latents
from miles.models.pipeline_config import TrainPipelineConfig

_ATTN = ("to_q", "to_k", "to_v", "to_out.0")
_ADD_ATTN = ("add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
QWEN_IMAGE_LORA_TARGET_MODULES: tuple[str, ...] = (
    *_ATTN,
    *_ADD_ATTN,
    "img_mlp.net.0.proj",
    "img_mlp.net.2",
    "txt_mlp.net.0.proj",
    "txt_mlp.net.2",
)


@register_train_pipeline_config("qwen_image")
class QwenImageTrainPipelineConfig(TrainPipelineConfig):
    description = "Qwen-Image text-to-image (MM-DiT, Qwen2.5-VL text encoder, true CFG), incl. tiny-qwen-image"
    hf_ckpt_name_patterns = ("qwen-image", "qwen_image", "qwenimage", "tiny-qwen-image")
    pipeline_class = "diffusers.QwenImagePipeline"
    transformer_class = "diffusers.QwenImageTransformer2DModel"
    lora_target_modules = QWEN_IMAGE_LORA_TARGET_MODULES
    condition_inputs = ("encoder_hidden_states", "encoder_hidden_states_mask")
    timestep_input_scale = 1.0 / 1000.0
    sde_timestep_divisor = 1000.0
    cfg_batching = False  # positive and negative text lengths differ: two forwards
    guidance_mode = "true_cfg"
    pipeline_sigmas = True
    max_sequence_length = 512
    packs_latents = True
    trainable = True
    sglang_model_id = "Qwen-Image"
    # measured with sglang 0.5.23: its Qwen-Image norm layers call sgl_kernel's fused CPU ops, which the
    # CPU build does not ship (no torch fallback); on GPUs the CUDA path runs
    sglang_cpu_blocker = "its Qwen-Image layers call sgl_kernel's fused norm CPU ops, absent from sglang's CPU build"
    sglang_text_encoders = 1  # Qwen2.5-VL
    # sglang packs the text stream's q/k/v projections into one GEMM (unquantized weights)
    sglang_fused_modules = MappingProxyType(
        {"attn.to_added_qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")}
    )

    def latent_channels(self, pipe: Any) -> int:
        return int(pipe.vae.config.z_dim)

    def config_pipe(self, configs: Any) -> Any:
        """QwenImagePipeline's VAE scale factor: 2 ** the number of the VAE's temporal-downsample flags."""
        pipe = super().config_pipe(configs)
        pipe.vae_scale_factor = 2 ** len(configs.get("vae", {}).get("temperal_downsample", [0, 0, 0]))
        return pipe

    def example_conditions(self, configs: Any, text_length: int) -> dict[str, Any]:
        """Qwen2.5-VL states `joint_attention_dim` wide at `text_length` tokens, the bound (a prompt's template-free
        length is at most that), so every token attends and the mask is None."""
        width = int(configs["transformer"]["joint_attention_dim"])
        return {
            "encoder_hidden_states": ((int(text_length), width), None),
            "encoder_hidden_states_mask": (None, None),  # all ones: the forward then passes no mask
        }

    # ---- text ------------------------------------------------------------------------------------
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
        """Text states (template dropped) and their mask (always materialised), per prompt batch."""
        import torch

        def encode(texts: list[str]) -> dict[str, Any]:
            embeds, mask = pipe.encode_prompt(
                prompt=texts, device=pipe._execution_device, max_sequence_length=max_sequence_length
            )
            if mask is None:
                mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
            return {"encoder_hidden_states": embeds, "encoder_hidden_states_mask": mask}

        positive = encode(prompts)
        if not do_cfg:
            return positive, None
        return positive, encode([negative_prompt if negative_prompt is not None else " "] * len(prompts))

    def collate_conditions(self, rows: list[Any]) -> dict[str, Any]:
        """Pad each row's text states `[L, D]` to the longest L with zeros, the mask with zeros."""
        import torch

        longest = max(int(r["encoder_hidden_states"].shape[0]) for r in rows)

        def pad(t: Any) -> Any:
            extra = longest - int(t.shape[0])
            return t if extra == 0 else torch.cat([t, t.new_zeros(extra, *t.shape[1:])])

        return {
            "encoder_hidden_states": torch.stack([pad(r["encoder_hidden_states"]) for r in rows]),
            "encoder_hidden_states_mask": torch.stack([pad(r["encoder_hidden_states_mask"]) for r in rows]),
        }

    def condition_row(self, batch: Mapping[str, Any], row: int) -> dict[str, Any]:
        """The row without the padding a longer prompt of its batch gave it (the mask's ones, padded on the
        right)."""
        mask = batch["encoder_hidden_states_mask"][row]
        length = int(mask.sum())
        return {
            "encoder_hidden_states": batch["encoder_hidden_states"][row, :length],
            "encoder_hidden_states_mask": mask[:length],
        }

    # ---- forward ---------------------------------------------------------------------------------
    def forward_velocity(self, transformer: Any, latents: Any, timestep: Any, cond: dict[str, Any]) -> Any:
        """Pack, run the DiT with `img_shapes` and t/1000 (mask None when all ones), unpack."""
        b, h, w = int(latents.shape[0]), int(latents.shape[-2]), int(latents.shape[-1])
        mask = cond["encoder_hidden_states_mask"]  # None: every token attends (the memory plan's trace)
        mask = None if mask is None or bool(mask.bool().all()) else mask.to(latents.device).long()
        out = transformer(
            hidden_states=pack_latents(latents),
            timestep=timestep.to(latents.dtype) / 1000,
            guidance=None,
            encoder_hidden_states_mask=mask,
            encoder_hidden_states=cond["encoder_hidden_states"],
            img_shapes=[(1, h // 2, w // 2)] * b,
            return_dict=False,
        )[0]
        return unpack_latents(out, h, w)

    def cfg_combine(self, pos: Any, neg: Any, scale: float) -> Any:
        """neg + s(pos - neg), then each packed token (C x 2 x 2 values) rescaled to pos's norm."""
        h, w = int(pos.shape[-2]), int(pos.shape[-1])
        pos_tokens = pack_latents(pos)
        combined = pack_latents(neg + scale * (pos - neg))
        combined = combined * (pos_tokens.norm(dim=-1, keepdim=True) / combined.norm(dim=-1, keepdim=True))
        return unpack_latents(combined, h, w)

    # ---- sglang adapter --------------------------------------------------------------------------
    def from_engine_conditions(self, cond_kwargs: Any, env: Any = None) -> dict[str, Any]:
        """Text states and a materialised mask: sglang sends `encoder_hidden_states_mask` only when a batch's
        prompts differ in length (None otherwise), with `txt_seq_lens`; a missing mask is built from those
        lengths (`position < length`), all ones when they cover every row."""
        import torch

        rows = super().from_engine_conditions(cond_kwargs, env)
        if "encoder_hidden_states_mask" not in rows:
            length = int(rows["encoder_hidden_states"].shape[0])
            lens = {int(v) for v in _flatten(cond_kwargs.get("txt_seq_lens"))}
            valid = min(lens.pop(), length) if len(lens) == 1 else length
            rows["encoder_hidden_states_mask"] = (torch.arange(length) < valid).float()
        return rows

    def from_engine_latents(self, latents: Any, height: int, width: int) -> Any:
        return unpack_engine_latents(latents, height, width)

    def from_engine_image(self, image: Any) -> Any:
        """sglang decodes with the video VAE and keeps its frame axis (`[3, 1, H, W]`): dropped here."""
        return (image[:, 0] if image.dim() == 4 and image.shape[1] == 1 else image).float()

    # ---- VAE: a causal video VAE used on one frame, normalised per channel ------------------------
    def _stats(self, vae: Any, like: Any) -> tuple[Any, Any]:
        import torch

        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(like.device, like.dtype)
        std = torch.tensor(vae.config.latents_std).view(shape).to(like.device, like.dtype)
        return mean, std

    def encode_images(self, pipe: Any, pixels: Any) -> Any:
        vae = pipe.vae
        z = vae.encode(pixels.to(vae.dtype)[:, :, None]).latent_dist.mean
        mean, std = self._stats(vae, z)
        return ((z - mean) / std)[:, :, 0]

    def decode_latents(self, pipe: Any, latents: Any) -> Any:
        vae = pipe.vae
        z = latents.to(vae.dtype)[:, :, None]
        mean, std = self._stats(vae, z)
        image = vae.decode(z * std + mean, return_dict=False)[0][:, :, 0]
        return (image.float() / 2 + 0.5).clamp(0, 1)


def _flatten(value: Any) -> list[Any]:
    """The scalars of a (nested) list, tuple or tensor; [] for None."""
    if value is None:
        return []
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _flatten(v)]
    return [value]
