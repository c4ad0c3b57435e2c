"""The `wan2_2_ti2v` family: Wan2.2-TI2V-5B and the embedded `tiny-wan2_2-ti2v`, image-to-video with one transformer.

Torch-free at import. `wan2_2`'s text (UMT5 states, zero-padded), VAE (per-channel normalisation, 5-D latents) and
schedule (Euler on the UniPC checkpoint's shifted grid) hold, with one transformer instead of two experts. What
TI2V-5B adds (`WanImageToVideoPipeline` with `expand_timesteps=True`) is one first-frame image per prompt row, in
the latents themselves:
  * the image, resized to the output's size (`video_processor.preprocess`), is VAE-encoded alone (posterior mode)
    and normalised per channel: `first_frame` `c0` [1, z, 1, h, w], recorded with the sample, both branches alike;
  * latent frame 0 IS `c0`: the pipeline feeds the DiT `(1 - m) c0 + m x_t` (m 0 on latent frame 0, 1 elsewhere)
    at every step, with a per-token timestep that is 0 on frame 0's tokens and t on the others
    (`[B, f h w / (p_h p_w)]`; the DiT modulates each token by its own), and replaces frame 0 by `c0` at the end.
So frame 0 is not generated. miles holds it: the engine's initial latents carry `c0` on frame 0 (`hold_latents`),
`forward_velocity` feeds the DiT frame 0 from `c0` (whatever the latents hold there: SFT's noised data too) and
returns velocity 0 there, and `generated_mask` (frames >= 1) keeps it out of the SDE step's noise and of every
log-prob, KL and loss (`step_mask`, `loss_mask`, NFT's mask). Every recorded latent then holds `c0` on frame 0, the
frames >= 1 are the pipeline's at every step, and the last latent is the pipeline's final one.
The per-token timestep is computed from the DiT's patch size (the pipeline hard-codes a 2x2 patch, `[:, ::2, ::2]`),
so a DiT of another spatial patch is served too (the pipeline itself cannot run it).
The text is encoded by `WanPipeline`'s UMT5 path, as `wan2_2_i2v` does (the I2V pipeline's own prompt cleaning
calls `ftfy` unconditionally).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from miles.models.families import register_train_pipeline_config
from miles.models.pipeline_config import TrainPipelineConfig
from miles.models.wan2_2.config import Wan22TrainPipelineConfig
from miles.models.wan2_2_i2v.config import Wan22I2VTrainPipelineConfig

FIRST_FRAME = "first_frame"  # the condition image's normalised latents, [z, 1, h, w] per sample


def token_timesteps(timestep: Any, grid: tuple[int, int, int], patch: tuple[int, ...]) -> Any:
    """The per-token timesteps `[B, (f / p_t)(h / p_h)(w / p_w)]` of TI2V's DiT for the rows' timesteps `[B]`: 0 on
    latent frame 0's tokens, the row's timestep on the others (the pipeline's `first_frame_mask[::p, ::p] * t`)."""
    import torch

    f, h, w = grid
    p_t, p_h, p_w = (int(p) for p in patch)
    if p_t != 1:
        raise ValueError(f"Wan2.2 TI2V holds latent frame 0 alone: a temporal patch of {p_t} would mix it with others")
    tokens = torch.ones(f, h // p_h, w // p_w, dtype=timestep.dtype, device=timestep.device)
    tokens[0] = 0
    return tokens.flatten()[None] * timestep.reshape(-1, 1)


@register_train_pipeline_config("wan2_2_ti2v")
class Wan22TI2VTrainPipelineConfig(Wan22TrainPipelineConfig):
    description = (
        "Wan2.2 image-to-video, TI2V-5B (one transformer; the first frame's latents replace latent frame 0, "
        "at timestep 0)"
    )
    hf_ckpt_name_patterns = ("wan2.2-ti2v", "wan2_2-ti2v", "wan2_2_ti2v", "wan2-2-ti2v", "wan22-ti2v", "wan22_ti2v")
    pipeline_class = "diffusers.WanImageToVideoPipeline"  # the hub saves WanPipeline; TI2V loads it into I2V's
    condition_inputs = ("encoder_hidden_states", FIRST_FRAME)
    condition_images = (1, 1)
    experts = ()
    weight_sync_targets = ("transformer",)
    fsdp_block_lists = ("blocks",)
    sglang_model_id = "Wan2.2-TI2V-5B-Diffusers"
    sglang_unserved = (
        "miles does not send condition images to sglang-diffusion yet (whether its server returns Wan2.2 TI2V "
        "trajectories with the first frame held is unverified); the in-process engine serves it"
    )

    @classmethod
    def model_index_score(cls, index: Mapping[str, Any]) -> int:
        """2 for a Wan pipeline saved with `expand_timesteps` true (the hub saves TI2V-5B as a `WanPipeline`, which
        `wan2_2` and `wan2_2_i2v` score 1 by their pipeline classes), else 0."""
        wan = index.get("_class_name") in ("WanPipeline", "WanImageToVideoPipeline")
        return 2 if wan and index.get("expand_timesteps") is True else 0

    # ---- one transformer: the base class's denoiser, schedule routing and checks ------------------------------
    def denoiser(self, pipe: Any) -> Any:
        return TrainPipelineConfig.denoiser(self, pipe)

    def load_denoiser(self, checkpoint: Any, dtype: Any, components: tuple[str, ...] = ("transformer",)) -> Any:
        return TrainPipelineConfig.load_denoiser(self, checkpoint, dtype, components)

    def compose_denoiser(self, modules: Mapping[str, Any]) -> Any:
        return TrainPipelineConfig.compose_denoiser(self, modules)

    def split_denoiser_state(self, state: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
        return TrainPipelineConfig.split_denoiser_state(self, state)

    def bind_checkpoint(self, checkpoint: Any) -> None:
        """No expert boundary to read."""

    def grid_experts(self, timesteps: Any, model_index: Any, scheduler_config: Any) -> list[str | None]:
        return [None] * len(timesteps)

    def trainable_steps(self, sigmas: Any, timesteps: Any, components: tuple[str, ...]) -> list[int] | None:
        return None

    def trainable_sigma_range(self, components: tuple[str, ...]) -> tuple[float, float] | None:
        return None

    def check_settings(self, res: Any, job: Any) -> None:
        """The base class's rules (not `wan2_2`'s second guidance scale: one transformer), and more than one frame:
        latent frame 0 is the condition image, so a one-frame output has nothing to generate."""
        TrainPipelineConfig.check_settings(self, res, job)
        frames = int(res["diffusion_output_num_frames"] or 1)
        if frames == 1:
            res.fail(
                f"{res.show('diffusion_output_num_frames')}: model family {self.name!r} holds latent frame 0 at the "
                "condition image, so one frame has nothing to generate; ask for 1 + a multiple of the VAE's temporal "
                "factor (e.g. 5 or 121)"
            )

    # ---- text: WanPipeline's UMT5 path (as wan2_2_i2v) --------------------------------------------------------
    encode_prompts = Wan22I2VTrainPipelineConfig.encode_prompts

    # ---- the first frame ------------------------------------------------------------------------------------
    def encode_media(self, pipe: Any, images: list[Any], height: int, width: int) -> dict[str, Any]:
        """The first frame resized to the output (`video_processor.preprocess`), VAE-encoded alone (posterior mode)
        and normalised per channel: `first_frame` [1, z, 1, h, w], as `WanImageToVideoPipeline.prepare_latents`
        with `expand_timesteps`."""
        import torch

        (image,) = images
        vae = pipe.vae
        pixels = pipe.video_processor.preprocess(image, height=height, width=width).to(torch.float32)
        video = pixels.unsqueeze(2).to(device=vae.device, dtype=vae.dtype)  # [1, 3, 1, H, W]
        latents = vae.encode(video).latent_dist.mode().to(torch.float32)
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, latents.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(latents.device, latents.dtype)
        return {FIRST_FRAME: (latents - mean) * inv_std}

    def example_media_conditions(self, latent_shape: tuple[int, ...], pipe: Any = None) -> dict[str, Any]:
        """The first frame's latents [z, 1, h, w] for a sample of `latent_shape` (z, f, h, w)."""
        c, _, h, w = (int(x) for x in latent_shape[-4:])
        return {FIRST_FRAME: ((c, 1, h, w), None)}

    def generated_mask(self, latent_shape: tuple[int, ...]) -> Any:
        """Every element of latent frames >= 1 (frame 0 is the condition image's latents)."""
        import torch

        mask = torch.ones(tuple(int(d) for d in latent_shape), dtype=torch.bool)
        mask[:, 0] = False
        return mask

    def hold_latents(self, latents: Any, cond: Mapping[str, Any]) -> Any:
        """The initial latents with frame 0 set to the condition's `first_frame`."""
        first = cond[FIRST_FRAME].to(latents.device, latents.dtype).expand(latents.shape[0], -1, -1, -1, -1)
        out = latents.clone()
        out[:, :, :1] = first
        return out

    def forward_velocity(self, transformer: Any, latents: Any, timestep: Any, cond: Mapping[str, Any]) -> Any:
        """The DiT on the latents with frame 0 replaced by `first_frame`, at per-token timesteps 0 on frame 0's
        tokens; its output on frames >= 1, velocity 0 on frame 0 (which the steps thereby keep)."""
        import torch

        first = cond[FIRST_FRAME]
        if tuple(first.shape[-2:]) != tuple(latents.shape[-2:]) or first.shape[-3] != 1:
            raise ValueError(
                f"a first-frame condition of latent grid {tuple(first.shape[-3:])} for latents of "
                f"{tuple(latents.shape[-3:])}: it was encoded for another size"
            )
        hidden = torch.cat([first.to(latents.dtype), latents[:, :, 1:]], dim=2)
        grid = tuple(int(d) for d in latents.shape[-3:])
        t_tok = token_timesteps(timestep, grid, transformer.config.patch_size)  # type: ignore[arg-type]
        out = transformer(
            hidden_states=hidden,
            timestep=t_tok,
            encoder_hidden_states=cond["encoder_hidden_states"],
            return_dict=False,
        )[0]
        return torch.cat([torch.zeros_like(out[:, :, :1]), out[:, :, 1:]], dim=2)
