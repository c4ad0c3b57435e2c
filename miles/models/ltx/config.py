"""The `ltx` family: LTX-2 (`LTX2Pipeline`) and the embedded `tiny-ltx2`, text-to-video with a joint audio stream.

Torch-free at import. LTX-2's DiT denoises a video latent and an audio latent together (each attends to the
other); the engines and the trainer carry ONE latent tensor per sample, so the family's natural latent holds
both streams:

    x = [C_v + k, f, h, w]   channels [0, C_v): the video latent (normalised, as LTX2Pipeline steps it)
                             channels [C_v, C_v + k): the audio latent, LTX2Pipeline's packed tokens
                             [L, D_a] (normalised) laid out row-major over those k planes of f*h*w cells,
                             the rest of the last plane zero padding (velocity 0: it never moves)

where k = ceil(L * D_a / (f*h*w)) and L = round(frames / fps * sample_rate / hop / audio_scale) as the
pipeline computes it. The trajectory therefore keeps the audio latents, and the trainer replays the joint
forward exactly. `forward_velocity` splits x, runs `LTX2VideoTransformer3DModel` with the pipeline's inputs
(coords from the geometry, `fps`, `audio_num_frames`, `sigma`, `use_cross_timestep`), converts each
velocity to x0 and back as the pipeline does, and joins the two velocities.

What sglang 0.5.23 serves: the video stream is stepped by SDE with rollout log-probs, audio by ODE
without them. `sde_mask` follows it on the in-process engine and in the trainer: video elements are
stochastic and scored, audio (and padding) elements take the ODE mean and are left out of the log-prob.
sglang itself is refused for ltx (`sglang_unserved`): it returns no audio latents, so the trainer could
not replay the joint forward.

`--rollout-patch-group ltx` (the reference's `patch_ltx2_disable_av_cross`): the audio<->video cross
attention is switched off (`isolate_modalities=True`) in the engine's and the trainer's forward alike, so
the video velocity no longer depends on the audio latents.

SFT trains the video stream only: the digits data has no audio, so `encode_images` gives the video latent and
zero audio planes, the loss reads the video channels (`data_mask`), and `--rollout-patch-group ltx` is required
so the video velocity does not depend on the audio planes it is not given. DMD2, NFT and DPO stay refused.

The reference's rules: unguided (guidance 1.0, no negative prompt), no CFG training; CPS sigma =
timestep / 1000.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from types import MappingProxyType, SimpleNamespace
from typing import Any, ClassVar

from miles.methods import METHODS
from miles.models.families import register_train_pipeline_config
from miles.models.pipeline_config import TrainPipelineConfig

DEFAULT_FPS = 24.0  # LTX2Pipeline's frame_rate default
# LTX2Pipeline's dynamic-shift constants (1024..4096 video tokens -> 0.95..2.05), where a scheduler config lacks them
DYNAMIC_SHIFT_DEFAULTS = MappingProxyType(
    {"base_image_seq_len": 1024, "max_image_seq_len": 4096, "base_shift": 0.95, "max_shift": 2.05}
)
PATCH_GROUP = "ltx"


@register_train_pipeline_config("ltx")
class LTXTrainPipelineConfig(TrainPipelineConfig):
    description = "LTX-2 text-to-video (audio-video DiT; video by SDE, audio by ODE)"
    hf_ckpt_name_patterns = ("ltx",)
    pipeline_class = "diffusers.LTX2Pipeline"
    transformer_class = "diffusers.LTX2VideoTransformer3DModel"
    lora_target_modules = ("to_q", "to_k", "to_v", "to_out.0", "net.0.proj", "net.2")
    condition_inputs = ("encoder_hidden_states", "audio_encoder_hidden_states", "encoder_attention_mask", "fps")
    supports_cfg_training = False
    sde_timestep_divisor = 1000.0
    optimizer_state_allowed_missing = ("audio",)
    input_dtype_policy = MappingProxyType({"latents": "default", "cond": "default", "timestep": None})
    makes_video = True
    pipeline_sigmas = True
    latent_patch = 1
    max_sequence_length = 1024
    trainable = True
    patch_groups: ClassVar[Mapping[str, str]] = MappingProxyType(
        {PATCH_GROUP: "audio<->video cross attention off in the engine's and the trainer's forward"}
    )
    sglang_unserved = (
        "sglang 0.5.23 steps LTX-2's audio without rollout log-probs and returns no audio latents (its "
        "rollout_api has no audio field), so the trainer could not replay the joint audio-video forward"
    )

    # what the checkpoint fixes (set by `bind_checkpoint` / `denoiser` / `load_denoiser`; LTX-2's by default)
    video_channels: int = 128
    dit_config: Any = None  # the DiT's config as `bind_checkpoint` read it (for a pipeline loaded without it)
    isolate_modalities: bool = False  # --rollout-patch-group ltx (`bind_args`)
    fps: float = DEFAULT_FPS  # --diffusion-fps (`bind_args`): the audio length, so the latent's shape, follow it

    def comfyui_lora_module(self, module: str) -> str:
        """ComfyUI's LTX models keep diffusers' names inside the blocks, under `diffusion_model.`."""
        return "diffusion_model." + module.removeprefix("transformer.")

    # ---- run settings and checkpoint constants ---------------------------------------------------
    def bind_args(self, args: Any) -> None:
        self.isolate_modalities = _has_patch_group(args.rollout_patch_group)
        fps = args.diffusion_fps
        self.fps = float(fps) if fps else DEFAULT_FPS

    def bind_checkpoint(self, checkpoint: Any) -> None:
        try:
            with open(os.path.join(os.fspath(checkpoint), "transformer", "config.json")) as f:
                config = json.load(f)
        except (OSError, ValueError):
            return
        self.video_channels = int(config.get("in_channels", self.video_channels))
        self.dit_config = SimpleNamespace(**config)

    def denoiser(self, pipe: Any) -> Any:
        self.video_channels = int(pipe.transformer.config.in_channels)
        return pipe.transformer

    def load_denoiser(self, checkpoint: Any, dtype: Any, components: tuple[str, ...] = ("transformer",)) -> Any:
        self.bind_checkpoint(checkpoint)
        return super().load_denoiser(checkpoint, dtype, components)

    # ---- the joint latent ------------------------------------------------------------------------
    @staticmethod
    def audio_num_frames(transformer_config: Any, latent_frames: int, temporal: int, fps: float) -> int:
        """LTX2Pipeline's audio latent length for a video of `(latent_frames - 1) * temporal + 1` frames."""
        frames = (latent_frames - 1) * temporal + 1
        per_second = (
            float(transformer_config.audio_sampling_rate)
            / float(transformer_config.audio_hop_length)
            / float(transformer_config.audio_scale_factor)
        )
        return round(frames / float(fps) * per_second)

    @staticmethod
    def audio_planes(cells: int, audio_frames: int, audio_dim: int) -> int:
        return math.ceil(audio_frames * audio_dim / cells)

    def latent_channels(self, pipe: Any) -> int:
        return int(pipe.transformer.config.in_channels)

    def latent_shape(self, pipe: Any, height: int, width: int, num_frames: int = 1) -> tuple[int, ...]:
        """`(C_v + k, f, h, w)`: the video latent's channels, then k planes holding the audio latent at the
        bound frame rate (`bind_args`: --diffusion-fps, else LTX2Pipeline's 24)."""
        return self.joint_shape(pipe, height, width, num_frames, self.fps)

    def joint_shape(self, pipe: Any, height: int, width: int, num_frames: int, fps: float) -> tuple[int, ...]:
        spatial = int(pipe.vae_spatial_compression_ratio)
        temporal = int(pipe.vae_temporal_compression_ratio)
        f, h, w = self.video_latent_grid(height, width, num_frames, spatial, temporal)
        config = self._dit(pipe)
        audio = self.audio_num_frames(config, f, temporal, fps)
        planes = self.audio_planes(f * h * w, audio, int(config.audio_in_channels))
        self.video_channels = int(config.in_channels)
        return (int(config.in_channels) + planes, f, h, w)

    def _dit(self, pipe: Any) -> Any:
        """The DiT's config: the loaded transformer's, else the checkpoint's (SFT encodes without the DiT)."""
        if getattr(pipe, "transformer", None) is not None:
            return pipe.transformer.config
        if self.dit_config is None:
            raise ValueError("model family 'ltx': the DiT's config is unknown (bind_checkpoint was not called)")
        return self.dit_config

    def data_mask(self, latent_shape: tuple[int, ...]) -> Any:
        """The video channels: SFT data holds a video and no audio, so the loss reads the video stream only."""
        return self.sde_mask(latent_shape)

    def image_seq_len(self, latent_shape: tuple[int, ...]) -> int:
        """The video token count f*h*w (LTX2Pipeline's `mu` reads the packed video sequence length)."""
        _, f, h, w = latent_shape
        return int(f) * int(h) * int(w)

    def schedule(
        self, scheduler: Any, num_steps: int, latent_shape: tuple[int, ...], flow_shift: float | None = None
    ) -> tuple[Any, Any]:
        """LTX2Pipeline's: sigmas linspace(1, 1/n, n) with `mu` from the video token count, its defaults
        (1024..4096 tokens -> 0.95..2.05) where the scheduler config lacks them."""
        if flow_shift is None and scheduler.config.get("use_dynamic_shifting", False):
            missing = {k: v for k, v in DYNAMIC_SHIFT_DEFAULTS.items() if k not in scheduler.config}
            if missing:
                scheduler = type(scheduler).from_config(scheduler.config, **missing)
        return super().schedule(scheduler, num_steps, latent_shape, flow_shift)

    def grid_schedule(
        self,
        scheduler_config: Mapping[str, Any],
        num_steps: int,
        token_count: Any = None,
        flow_shift: float | None = None,
    ) -> tuple[list[float], list[float]]:
        """`schedule` without torch: the base class's, with LTX2Pipeline's dynamic-shift constants for the keys the
        scheduler's config lacks (as `schedule` adds them to the live scheduler's config)."""
        from miles.models.scheduler_grid import live_scheduler_config

        config = live_scheduler_config(scheduler_config)
        if flow_shift is None and config.get("use_dynamic_shifting", False):
            config.update({k: v for k, v in DYNAMIC_SHIFT_DEFAULTS.items() if k not in config})
        return super().grid_schedule(config, num_steps, token_count, flow_shift)

    def grid_token_count(
        self, configs: Mapping[str, Mapping[str, Any]], height: int, width: int, num_frames: int = 1
    ) -> int:
        """`image_seq_len` (f*h*w video tokens) with the video VAE's compression as `AutoencoderKLLTX2Video` sets it
        (`spatial_compression_ratio` / `temporal_compression_ratio`, else patch x 2**scalings; LTX2Pipeline's 32 / 8
        without a VAE config)."""
        spatial, temporal = _vae_compression(configs.get("vae"))
        return self.image_seq_len((0, *self.video_latent_grid(height, width, num_frames, spatial, temporal)))

    def sde_mask(self, latent_shape: tuple[int, ...]) -> Any:
        """Video channels stochastic (SDE, scored); audio and padding by ODE (as sglang steps LTX-2)."""
        import torch

        mask = torch.zeros(tuple(int(d) for d in latent_shape), dtype=torch.bool)
        mask[: self.video_channels] = True
        return mask

    def split(self, transformer: Any, latents: Any, fps: float) -> tuple[Any, Any, int]:
        """Joint latents [B, C_v + k, f, h, w] -> (video tokens [B, f*h*w, C_v], audio tokens [B, L, D_a], L)."""
        config = transformer.config
        cv = int(config.in_channels)
        b, _, f, h, w = latents.shape
        temporal = int(config.vae_scale_factors[0])
        audio = self.audio_num_frames(config, f, temporal, fps)
        dim = int(config.audio_in_channels)
        if latents.shape[1] != cv + self.audio_planes(f * h * w, audio, dim):
            raise ValueError(
                f"ltx latents {tuple(latents.shape)} do not hold {cv} video channels and {audio} audio tokens "
                f"x {dim} at {fps} fps"
            )
        video = latents[:, :cv].permute(0, 2, 3, 4, 1).reshape(b, f * h * w, cv)
        audio_tokens = latents[:, cv:].reshape(b, -1)[:, : audio * dim].reshape(b, audio, dim)
        return video, audio_tokens, audio

    @staticmethod
    def join(video: Any, audio: Any, like: Any) -> Any:
        """(video [B, f*h*w, C_v], audio [B, L, D_a]) -> [B, C_v + k, f, h, w] shaped as `like` (zero padding)."""
        import torch

        b, c, f, h, w = like.shape
        cv = video.shape[-1]
        out_video = video.reshape(b, f, h, w, cv).permute(0, 4, 1, 2, 3)
        flat = audio.reshape(b, -1)
        pad = (c - cv) * f * h * w - flat.shape[1]
        out_audio = torch.cat([flat, flat.new_zeros(b, pad)], dim=1).reshape(b, c - cv, f, h, w)
        return torch.cat([out_video, out_audio.to(out_video.dtype)], dim=1)

    # ---- text --------------------------------------------------------------------------------------
    def encode_prompts(
        self,
        pipe: Any,
        prompts: list[str],
        negative_prompt: str | None,
        do_cfg: bool,
        max_sequence_length: int,
        guidance: float | None = None,
        geometry: Mapping[str, Any] | None = None,
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """Gemma's stacked hidden states through the connectors (the video and audio text streams and their
        mask), as LTX2Pipeline encodes them; the frame rate (`geometry['fps']`, the pipeline's 24 by default)
        rides along, since the DiT's positions and the audio length depend on it. Unguided only."""
        import torch

        if do_cfg:
            raise ValueError("model family 'ltx' samples unguided (--diffusion-guidance-scale 1.0)")
        device = pipe._execution_device
        embeds, mask, _, _ = pipe.encode_prompt(
            prompt=prompts,
            do_classifier_free_guidance=False,
            max_sequence_length=max_sequence_length,
            device=device,
        )
        padding_side = getattr(getattr(pipe, "tokenizer", None), "padding_side", "left")
        video, audio, connector_mask = pipe.connectors(embeds, mask, padding_side=padding_side)
        fps = float((geometry or {}).get("fps") or DEFAULT_FPS)
        cond = {
            "encoder_hidden_states": video,
            "audio_encoder_hidden_states": audio,
            "encoder_attention_mask": connector_mask.to(video.dtype),
            "fps": torch.full((len(prompts), 1), fps, dtype=torch.float32, device=video.device),
        }
        return cond, None

    # ---- forward -------------------------------------------------------------------------------------
    def forward_velocity(self, transformer: Any, latents: Any, timestep: Any, cond: Mapping[str, Any]) -> Any:
        """The joint velocity: LTX2Pipeline's transformer call on the split streams, each velocity converted to
        x0 and back at sigma = t / 1000 in fp32 (the pipeline's `convert_velocity_to_x0` round trip), joined."""
        import torch

        fps_rows = cond["fps"].reshape(-1).float()
        fps = float(fps_rows[0])
        if not bool((fps_rows == fps).all()):
            raise ValueError("ltx: a batch mixes frame rates; its rows' positions and audio lengths differ")
        b, _, f, h, w = latents.shape
        video, audio, audio_frames = self.split(transformer, latents, fps)
        t = timestep.reshape(-1)
        if t.numel() == 1 and b > 1:
            t = t.expand(b)
        device = latents.device
        video_coords = transformer.rope.prepare_video_coords(b, f, h, w, device, fps=fps)
        audio_coords = transformer.audio_rope.prepare_audio_coords(b, audio_frames, device)
        # the DiT's own dtype (stored conditions are fp32; a bf16-master trainer has no FSDP input cast)
        dtype = next(transformer.parameters()).dtype
        text_mask = cond["encoder_attention_mask"].to(dtype)
        v_video, v_audio = transformer(
            hidden_states=video.to(dtype),
            audio_hidden_states=audio.to(dtype),
            encoder_hidden_states=cond["encoder_hidden_states"].to(dtype),
            audio_encoder_hidden_states=cond["audio_encoder_hidden_states"].to(dtype),
            timestep=t,
            sigma=t,
            encoder_attention_mask=text_mask,
            audio_encoder_attention_mask=text_mask,
            num_frames=f,
            height=h,
            width=w,
            fps=fps,
            audio_num_frames=audio_frames,
            video_coords=video_coords,
            audio_coords=audio_coords,
            isolate_modalities=self.isolate_modalities,
            use_cross_timestep=True,
            return_dict=False,
        )
        sigma = (t.float() / 1000.0).view(-1, 1, 1)
        v_video = _x0_round_trip(video.float(), v_video.float(), sigma)
        v_audio = _x0_round_trip(audio.float(), v_audio.float(), sigma)
        return self.join(v_video, v_audio, latents).to(torch.float32)

    # ---- the video VAE ---------------------------------------------------------------------------------
    def _stats(self, vae: Any, like: Any) -> tuple[Any, Any, float]:
        mean = vae.latents_mean.view(1, -1, 1, 1, 1).to(like.device, like.dtype)
        std = vae.latents_std.view(1, -1, 1, 1, 1).to(like.device, like.dtype)
        return mean, std, float(vae.config.scaling_factor)

    def encode_images(self, pipe: Any, pixels: Any) -> Any:
        """Videos [B, 3, F, H, W] in [-1, 1] -> joint latents [B, C_v + k, f, h, w]: the normalised video latent
        (the posterior mean, LTX2Pipeline's normalisation) and zero audio planes. The data has no audio: SFT
        reads the video channels only (`data_mask`) and runs with the audio<->video cross attention off
        (`--rollout-patch-group ltx`, required by `check_settings`), so the video velocity never sees them."""
        import torch

        vae = pipe.vae
        video = pixels if pixels.dim() == 5 else pixels[:, :, None]
        z = vae.encode(video.to(vae.dtype)).latent_dist.mean
        mean, std, scaling = self._stats(vae, z)
        z = (z - mean) * scaling / std
        shape = self.joint_shape(pipe, video.shape[3], video.shape[4], video.shape[2], self.fps)
        if z.shape[1] != self.video_channels or tuple(z.shape[2:]) != tuple(shape[1:]):
            raise ValueError(f"ltx: the video VAE gave latents {tuple(z.shape)}; the DiT expects {shape}")
        audio = z.new_zeros(z.shape[0], shape[0] - self.video_channels, *shape[1:])
        return torch.cat([z, audio], dim=1).float()

    def decode_latents(self, pipe: Any, latents: Any) -> Any:
        """The video channels -> videos [B, 3, F, H, W] in [0, 1] (one frame: images [B, 3, H, W]), as
        LTX2Pipeline decodes them at decode_timestep 0; the audio is not decoded (rewards read the video)."""
        import torch

        vae = pipe.vae
        z = latents[:, : int(pipe.transformer.config.in_channels)].to(vae.dtype)
        mean, std, scaling = self._stats(vae, z)
        z = z * std / scaling + mean
        timestep = None
        if vae.config.timestep_conditioning:
            timestep = torch.zeros(z.shape[0], device=z.device, dtype=z.dtype)
        video = vae.decode(z, timestep, return_dict=False)[0]
        video = (video.float() / 2 + 0.5).clamp(0, 1)
        return video[:, :, 0] if video.shape[2] == 1 else video

    # ---- validation -------------------------------------------------------------------------------
    def check_settings(self, res: Any, job: Any) -> None:
        super().check_settings(res, job)
        if res["diffusion_guidance_scale"] != 1.0:
            res.fail(f"{res.show('diffusion_guidance_scale')}: the ltx family trains unguided (use 1.0)")
        if res["diffusion_negative_prompt"] is not None:
            res.fail(f"{res.show('diffusion_negative_prompt')}: the ltx family takes no negative prompt")
        if res["sde_step_backend_path"] is not None:
            res.fail(
                f"{res.show('sde_step_backend_path')}: model family 'ltx' steps its audio by ODE inside the SDE "
                "step (sde_mask), which a custom backend does not implement; use the built-in backends"
            )
        known = METHODS.get(res["loss_type"])  # None under eval / rollout-only without a loss type
        if job.distills or (known is not None and known.renoises_samples):
            what = f"`miles {job.command}`" if job.distills else res.show("loss_type")
            renoising = ", ".join(m.name for m in METHODS.values() if m.renoises_samples and m.jobs)
            res.fail(
                f"{what}: model family 'ltx' trains Flow-GRPO, and SFT on its video stream only (the methods that "
                f"re-noise clean samples, {renoising}, would need audio latents for the data)"
            )
        if job.trains_on_dataset and not _has_patch_group(res["rollout_patch_group"]):
            res.fail(
                f"`miles {job.command}` for model family 'ltx' trains the video stream only (the data has no audio) "
                f"and needs --rollout-patch-group {PATCH_GROUP} (audio<->video cross attention off), so the video "
                "velocity does not depend on the audio it is not given"
            )


def _vae_compression(vae: Mapping[str, Any] | None) -> tuple[int, int]:
    """(spatial, temporal) compression of an `AutoencoderKLLTX2Video` config (its constructor's rule and defaults);
    (32, 8), LTX2Pipeline's, without one."""
    if not vae:
        return 32, 8
    scaling = vae.get("spatio_temporal_scaling", (True, True, True, True))
    if isinstance(scaling, bool):  # one flag per encoder block but the last
        scaling = (scaling,) * (len(vae.get("layers_per_block", (4, 6, 6, 2, 2))) - 1)
    doubles = sum(bool(x) for x in scaling)
    spatial = vae.get("spatial_compression_ratio")
    temporal = vae.get("temporal_compression_ratio")
    spatial = int(vae.get("patch_size", 4)) * 2**doubles if spatial is None else int(spatial)
    temporal = int(vae.get("patch_size_t", 1)) * 2**doubles if temporal is None else int(temporal)
    return spatial, temporal


def _has_patch_group(groups: Any) -> bool:
    """Whether --rollout-patch-group names the ltx group (audio<->video cross attention off)."""
    return PATCH_GROUP in [str(g).strip() for g in (groups or [])]


def _x0_round_trip(x: Any, v: Any, sigma: Any) -> Any:
    """`(x - (x - v * sigma)) / sigma`: LTX2Pipeline's velocity -> x0 -> velocity conversion in fp32."""
    x0 = x - v * sigma
    return (x - x0) / sigma
