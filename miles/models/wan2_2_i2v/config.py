"""The `wan2_2_i2v` family: Wan2.2-I2V-A14B and the embedded `tiny-wan2_2-i2v`, image-to-video with two experts.

Torch-free at import. Everything of `wan2_2` holds (5-D latents, the two experts split at the checkpoint's
`boundary_ratio`, Euler on the UniPC checkpoint's shifted grid, UMT5 states, the per-channel VAE normalisation);
what I2V-A14B adds is one first-frame image per prompt row, on the DiT's input channels
(`WanImageToVideoPipeline` without an image encoder, `expand_timesteps` False):
  * the image is resized to the output's size (the pipeline's `video_processor.preprocess`), followed by
    frames - 1 zero frames (mid-gray in [-1, 1]) and VAE-encoded as one video (posterior mode), normalised per
    channel like the latents: `c` [1, z, f, h, w];
  * a mask, 1 on the first pixel frame (repeated by the VAE's temporal factor T) and 0 on the others, laid out
    as T channels of the latent frames: `m` [1, T, f, h, w];
  * `image_condition = cat([m, c], dim=1)` [1, T + z, f, h, w] (real: 4 + 16 = 20; the experts' in_channels
    are 2z + T = 36 and their out_channels z) is recorded with the sample, both branches alike, and every DiT
    call gets `cat([x_t, image_condition], dim=1)`. The condition is an input only: the trajectory, the SDE
    steps, the log-probs and every loss hold the generated latents `x_t` alone (all z channels of all frames:
    frame 0 is generated, softly tied to the image).
The video's frame count is a run setting (`bind_args`: `--diffusion-output-num-frames`), which the encode reads.
Wan2.2-TI2V-5B (`expand_timesteps=True`: latent frame 0 replaced by the image and given timestep 0) is another
layout, the `wan2_2_ti2v` family. The text is encoded by `WanPipeline`'s UMT5 path (the same computation; the I2V
pipeline's own prompt cleaning calls `ftfy` unconditionally).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from miles.models.families import register_train_pipeline_config
from miles.models.wan2_2.config import Wan22TrainPipelineConfig

IMAGE_CONDITION = "image_condition"
A14B_MASK_CHANNELS = 4  # Wan2.2's VAE temporal factor: the mask's channels


def first_frame_mask(num_frames: int, temporal: int, latent_frames: int, h: int, w: int, like: Any) -> Any:
    """The I2V-A14B mask [1, T, f, h, w]: 1 where the pixel frame is the first (its T copies fill latent frame
    0's T channels), 0 elsewhere, as `WanImageToVideoPipeline.prepare_latents` lays it out."""
    import torch

    mask = torch.zeros(1, 1, num_frames, h, w, dtype=like.dtype, device=like.device)
    mask[:, :, 0] = 1
    first = torch.repeat_interleave(mask[:, :, 0:1], repeats=temporal, dim=2)
    mask = torch.cat([first, mask[:, :, 1:]], dim=2)  # T * f frames
    return mask.view(1, latent_frames, temporal, h, w).transpose(1, 2)


@register_train_pipeline_config("wan2_2_i2v")
class Wan22I2VTrainPipelineConfig(Wan22TrainPipelineConfig):
    description = (
        "Wan2.2 image-to-video, I2V-A14B (two experts; the first frame's mask and VAE latents on the input channels)"
    )
    hf_ckpt_name_patterns = ("wan2.2-i2v", "wan2_2-i2v", "wan2_2_i2v", "wan2-2-i2v", "wan22-i2v", "wan22_i2v")
    pipeline_class = "diffusers.WanImageToVideoPipeline"
    condition_inputs = ("encoder_hidden_states", IMAGE_CONDITION)
    condition_images = (1, 1)
    default_boundary_ratio: ClassVar[float] = 0.9  # Wan2.2-I2V-A14B's (its model_index.json)
    boundary: float = 900.0  # set from the checkpoint by `bind_checkpoint`
    num_frames: int = 1  # --diffusion-output-num-frames (`bind_args`): the condition video's length
    mask_channels: int = A14B_MASK_CHANNELS  # the VAE's temporal factor (`latent_shape` reads it from the VAE)
    sglang_model_id = "Wan2.2-I2V-A14B-Diffusers"
    sglang_unserved = (
        "miles does not send condition images to sglang-diffusion yet (whether its server returns Wan2.2 I2V "
        "trajectories is unverified); the in-process engine serves it"
    )

    def bind_args(self, args: Any) -> None:
        super().bind_args(args)
        self.num_frames = int(args.diffusion_output_num_frames or 1)

    def latent_shape(self, pipe: Any, height: int, width: int, num_frames: int = 1) -> tuple[int, ...]:
        self.mask_channels = int(pipe.vae_scale_factor_temporal)
        return super().latent_shape(pipe, height, width, num_frames)

    # ---- text: WanPipeline's UMT5 path ----------------------------------------------------------------
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
        """UMT5 states (zero past each prompt's tokens) as `WanPipeline.encode_prompt` makes them, which is what
        `WanImageToVideoPipeline.encode_prompt` computes where it runs (it cleans the prompt with `ftfy`
        unconditionally, a NameError without ftfy installed); the negative prompt defaults to ""."""
        from diffusers import WanPipeline

        def states(texts: list[str]) -> Any:
            return WanPipeline._get_t5_prompt_embeds(
                pipe, prompt=texts, max_sequence_length=max_sequence_length, device=pipe._execution_device
            )

        pos = {"encoder_hidden_states": states(list(prompts))}
        if not do_cfg:
            return pos, None
        return pos, {"encoder_hidden_states": states([negative_prompt or ""] * len(prompts))}

    # ---- the first frame ---------------------------------------------------------------------------------
    def encode_media(self, pipe: Any, images: list[Any], height: int, width: int) -> dict[str, Any]:
        """The first frame resized to the output (`video_processor.preprocess`), followed by `num_frames - 1` zero
        frames, VAE-encoded as one video (posterior mode) and normalised per channel; the first-frame mask before
        it on the channels: `image_condition` [1, T + z, f, h, w], as `WanImageToVideoPipeline.prepare_latents`."""
        import torch

        (image,) = images
        vae = pipe.vae
        frames = int(self.num_frames)
        temporal = int(pipe.vae_scale_factor_temporal)
        if (frames - 1) % temporal:
            raise ValueError(f"{frames} frames: Wan2.2 I2V needs 1 + a multiple of {temporal} (the VAE's factor)")
        pixels = pipe.video_processor.preprocess(image, height=height, width=width).to(torch.float32)
        pixels = pixels.unsqueeze(2)  # [1, 3, 1, H, W]
        video = torch.cat([pixels, pixels.new_zeros(1, pixels.shape[1], frames - 1, *pixels.shape[-2:])], dim=2)
        latents = vae.encode(video.to(device=vae.device, dtype=vae.dtype)).latent_dist.mode().to(torch.float32)
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, latents.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(latents.device, latents.dtype)
        latents = (latents - mean) * inv_std
        f, h, w = latents.shape[-3:]
        mask = first_frame_mask(frames, temporal, f, h, w, latents)
        return {IMAGE_CONDITION: torch.cat([mask, latents], dim=1)}

    def forward_velocity(self, transformer: Any, latents: Any, timestep: Any, cond: Mapping[str, Any]) -> Any:
        """The experts on `cat([x_t, image_condition], dim=1)`; their output is the z generated channels."""
        import torch

        condition = cond[IMAGE_CONDITION]
        if tuple(condition.shape[-3:]) != tuple(latents.shape[-3:]):
            raise ValueError(
                f"a first-frame condition of latent grid {tuple(condition.shape[-3:])} for latents of "
                f"{tuple(latents.shape[-3:])}: it was encoded for another frame count or size"
            )
        hidden = torch.cat([latents, condition.to(latents.dtype)], dim=1)
        out = transformer(
            hidden_states=hidden,
            timestep=timestep,
            encoder_hidden_states=cond["encoder_hidden_states"],
            return_dict=False,
        )
        return out[0]

    def example_media_conditions(self, latent_shape: tuple[int, ...], pipe: Any = None) -> dict[str, Any]:
        """The mask and the first frame's latents [T + z, f, h, w] for a sample of `latent_shape` (C, f, h, w)."""
        c, f, h, w = (int(x) for x in latent_shape[-4:])
        return {IMAGE_CONDITION: ((self.mask_channels + c, f, h, w), None)}
