"""The `cosmos3` family: Cosmos3 (Edge / Nano / Super) and the embedded `tiny-cosmos3`, text-to-image and
text-to-video with an omni mixture-of-transformers.

Torch-free at import. What differs from the other families, all inside this config:
  * no text encoder: the language model IS the denoiser; a prompt becomes token ids through the pipeline's
    chat template, which states the output's size (and, for a video, its duration and frame rate), so
    `encode_prompts` needs the geometry. The conditions are `text_ids` / `text_mask` (padded to a batch's
    longest prompt) and `fps`, as the reference's CondKwargs carry them;
  * one packed sample per forward: text tokens then vision tokens in one sequence with 3-D mRoPE positions,
    built by the pipeline's own packing helpers. `forward_velocity` runs the rows one by one (the trainer and
    the engine still hand it a batch), so `--rollout-microgroup-size` must be 1, as in the reference;
  * latents `[B, C, f, h, w]` in the Wan2.2 VAE's layout (an image is one latent frame), normalised per
    channel as `Cosmos3OmniPipeline` does;
  * the checkpoint ships UniPC (multistep, not a Gaussian step): rollouts step Euler on UniPC's own sigma
    grid (timesteps sigma x 1000), as sglang's rollout scheduler does; the DiT scales the timestep inside;
  * LoRA on the generation path: its attention projections and its MLP (`mlp_moe_gen`).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType, SimpleNamespace
from typing import Any, ClassVar

from miles.models.families import register_train_pipeline_config
from miles.models.pipeline_config import TrainPipelineConfig

COSMOS3_LORA_TARGET_MODULES: tuple[str, ...] = (
    "add_q_proj",
    "add_k_proj",
    "add_v_proj",
    "to_add_out",
    "mlp_moe_gen.gate_proj",
    "mlp_moe_gen.up_proj",
    "mlp_moe_gen.down_proj",
)
DEFAULT_FPS = 24.0  # Cosmos3OmniPipeline's default frame rate


@register_train_pipeline_config("cosmos3")
class Cosmos3TrainPipelineConfig(TrainPipelineConfig):
    description = "Cosmos3 (Edge / Nano / Super) text-to-image / text-to-video, mixture-of-transformers"
    hf_ckpt_name_patterns = ("cosmos3", "cosmos-3", "cosmos_3")
    pipeline_class = "diffusers.Cosmos3OmniPipeline"
    transformer_class = "diffusers.Cosmos3OmniTransformer"
    lora_target_modules = COSMOS3_LORA_TARGET_MODULES
    comfyui_lora = False
    comfyui_lora_missing = "ComfyUI's core has no Cosmos3 model (only custom nodes load it)"
    condition_inputs = ("text_ids", "text_mask", "fps")
    cfg_batching = False  # one packed sample per forward (the reference asserts it off)
    input_dtype_policy = MappingProxyType({"latents": None, "cond": None, "timestep": "fp32"})
    sde_timestep_divisor = 1000.0
    makes_video = True
    fsdp_block_lists = ("layers",)
    trainable = True
    # sglang detects Cosmos3 by its pipeline class name ("cosmos3omni"): no --model-id needed
    sglang_model_id = None
    sglang_text_encoders = 0  # no text encoder: no --text-encoder-precisions
    # sglang's Cosmos3 pipeline runs NVIDIA's guardrails unless told not to (the reference's recipe sets it)
    sglang_server_env = MappingProxyType({"SGLANG_DISABLE_COSMOS3_GUARDRAILS": "1"})
    # measured with sglang 0.5.23 on tiny-cosmos3: its port's post_load_weights casts the token embedding, proj_in/out
    # and the norms to bf16 whatever --dit-precision says, so an fp32 server fails its first forward (bf16 text
    # states into fp32 projections) and aborts at warm-up; at bf16 it serves T2I rollouts with trajectories
    sglang_dit_precisions = ("bf16",)
    sglang_precision_reason = (
        "its Cosmos3 port casts the embeddings and norms to bf16 whatever the DiT precision, so an fp32 server "
        "fails its first forward"
    )
    temporal_factor: ClassVar[int] = 4  # the VAE's; set from the checkpoint by `bind_checkpoint` / `denoiser`
    # sglang's port (sglang 0.5.23, configs/models/dits/cosmos3video.py `_build_cosmos3_param_names_mapping`) names
    # the modules its own way and fuses some (`sglang_module`); its post_load_weights keeps the time embedder in
    # fp32 at any DiT precision, and it pads the token embedding's rows to a multiple of 64 with zeros
    sglang_fp32_modules = ("time_embedder",)
    sglang_vocab_padding: ClassVar[int] = 64
    gated_mlp: ClassVar[bool] = True  # SwiGLU MLPs (gate_proj + up_proj); "relu2" checkpoints: dense up/down

    # ---- schedule: Euler on UniPC's sigma grid ---------------------------------------------------
    def schedule(
        self, scheduler: Any, num_steps: int, latent_shape: tuple[int, ...], flow_shift: float | None = None
    ) -> tuple[Any, Any]:
        """UniPC's own sigmas for `num_steps` (with `--diffusion-flow-shift` as its flow_shift), the timesteps
        sigma x 1000 in fp32: the grid an Euler step walks. A flow-matching Euler checkpoint: the base class."""
        if "flow_shift" not in scheduler.config and "use_flow_sigmas" not in scheduler.config:
            return super().schedule(scheduler, num_steps, latent_shape, flow_shift)
        import copy

        import torch

        if flow_shift is not None:
            scheduler = type(scheduler).from_config(scheduler.config, flow_shift=float(flow_shift))
        else:
            scheduler = copy.deepcopy(scheduler)
        scheduler.set_timesteps(num_steps, device="cpu")
        sigmas = torch.as_tensor(scheduler.sigmas).detach().to("cpu", torch.float32).clone()
        steps = int(scheduler.config.num_train_timesteps)
        return sigmas, sigmas[:-1] * steps

    def grid_schedule(
        self,
        scheduler_config: Mapping[str, Any],
        num_steps: int,
        token_count: Any = None,
        flow_shift: float | None = None,
    ) -> tuple[list[float], list[float]]:
        """`schedule` without torch: UniPC's own sigmas (at `flow_shift` when given), timesteps sigma x N in fp32."""
        import numpy as np

        from miles.models.scheduler_grid import live_scheduler_config, unipc_flow_sigmas

        config = live_scheduler_config(scheduler_config)
        if "flow_shift" not in config and "use_flow_sigmas" not in config:
            return super().grid_schedule(config, num_steps, token_count, flow_shift)
        if flow_shift is not None:
            config["flow_shift"] = float(flow_shift)
        sigmas = unipc_flow_sigmas(config, num_steps)
        timesteps = sigmas[:-1] * np.float32(int(config["num_train_timesteps"]))
        return [float(x) for x in sigmas], [float(x) for x in timesteps]

    def grid_token_count(
        self, configs: Mapping[str, Mapping[str, Any]], height: int, width: int, num_frames: int = 1
    ) -> int:
        """`image_seq_len` of the latent shape, with `Cosmos3OmniPipeline`'s VAE factors (the VAE config's
        `scale_factor_spatial` / `scale_factor_temporal`; 16 and 4 without a VAE config)."""
        vae = dict(configs.get("vae") or {})
        pipe = SimpleNamespace(
            vae=SimpleNamespace(config=SimpleNamespace(z_dim=int(vae.get("z_dim", 16)))),
            vae_scale_factor_spatial=int(vae["scale_factor_spatial"]) if configs.get("vae") else 16,
            vae_scale_factor_temporal=int(vae["scale_factor_temporal"]) if configs.get("vae") else 4,
        )
        return self.image_seq_len(self.latent_shape(pipe, height, width, num_frames))

    # ---- the checkpoint's constants -------------------------------------------------------------
    def bind_checkpoint(self, checkpoint: Any) -> None:
        """Read the VAE's temporal factor (the mRoPE frame positions use it) and whether the DiT's MLPs are
        gated (sglang fuses a gated MLP's gate and up projections)."""
        import json
        import os

        try:
            with open(os.path.join(os.fspath(checkpoint), "vae", "config.json")) as f:
                self.temporal_factor = int(json.load(f).get("scale_factor_temporal", 4))
        except (OSError, ValueError):
            pass
        try:
            with open(os.path.join(os.fspath(checkpoint), "transformer", "config.json")) as f:
                self.gated_mlp = json.load(f).get("hidden_act", "silu") != "relu2"
        except (OSError, ValueError):
            pass

    def denoiser(self, pipe: Any) -> Any:
        self.temporal_factor = int(pipe.vae_scale_factor_temporal)
        return pipe.transformer

    def load_denoiser(self, checkpoint: Any, dtype: Any, components: tuple[str, ...] = ("transformer",)) -> Any:
        self.bind_checkpoint(checkpoint)
        return super().load_denoiser(checkpoint, dtype, components)

    # ---- text: token ids through the chat template ------------------------------------------------
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
        """`Cosmos3OmniPipeline.tokenize_prompt` per prompt at the output's size, frame count and fps (its
        templates state them), padded to the longest with a mask; the negative prompt defaults to "" there."""
        g = dict(geometry or {})
        frames = int(g.get("num_frames") or 1)
        fps = float(g.get("fps") or DEFAULT_FPS)
        pos_ids, neg_ids = [], []
        for prompt in prompts:
            cond, uncond = pipe.tokenize_prompt(
                prompt,
                negative_prompt,
                num_frames=frames,
                height=int(g.get("height") or 720),
                width=int(g.get("width") or 1280),
                fps=fps,
            )
            pos_ids.append(cond)
            neg_ids.append(uncond)
        positive = _id_rows(pos_ids, fps)
        return positive, (_id_rows(neg_ids, fps) if do_cfg else None)

    def collate_conditions(self, rows: list[Mapping[str, Any]]) -> dict[str, Any]:
        """Pad each row's ids and mask `[L]` to the longest L (mask zero there); stack the fps."""
        import torch

        longest = max(int(r["text_ids"].shape[0]) for r in rows)

        def pad(t: Any) -> Any:
            extra = longest - int(t.shape[0])
            return t if extra == 0 else torch.cat([t, t.new_zeros(extra)])

        return {
            "text_ids": torch.stack([pad(r["text_ids"]) for r in rows]),
            "text_mask": torch.stack([pad(r["text_mask"]) for r in rows]),
            "fps": torch.stack([r["fps"].reshape(1) for r in rows]),
        }

    def condition_row(self, batch: Mapping[str, Any], row: int) -> dict[str, Any]:
        """The row's ids and mask without the padding a longer prompt of its batch gave them."""
        length = int(batch["text_mask"][row].sum())
        return {
            "text_ids": batch["text_ids"][row, :length],
            "text_mask": batch["text_mask"][row, :length],
            "fps": batch["fps"][row],
        }

    # ---- forward: one packed sample at a time --------------------------------------------------------
    def forward_velocity(self, transformer: Any, latents: Any, timestep: Any, cond: Mapping[str, Any]) -> Any:
        """Each row packed as `Cosmos3OmniPipeline` packs its one sample (text ids, then the vision tokens, with
        the pipeline's own mRoPE positions and fps), run on its own; the rows' velocities stacked."""
        import torch
        from diffusers import Cosmos3OmniPipeline

        config = _dit(transformer).config
        shim = SimpleNamespace(
            transformer=SimpleNamespace(config=config), vae_scale_factor_temporal=self.temporal_factor
        )
        device = latents.device
        outputs = []
        for b in range(int(latents.shape[0])):
            mask = cond["text_mask"][b] > 0
            ids = cond["text_ids"][b][mask].round().long().tolist()
            fps = float(cond["fps"][b].reshape(-1)[0])
            row = latents[b : b + 1]
            text = Cosmos3OmniPipeline._prepare_text_segment(shim, ids, device=device)
            vision = Cosmos3OmniPipeline._prepare_vision_segment(
                shim,
                input_vision_tokens=row,
                has_image_condition=False,
                mrope_offset=text["vision_start_temporal_offset"],
                vision_fps=fps,
                curr=text["und_len"],
                device=device,
                condition_frame_indexes=[],
            )
            t = torch.full((vision["num_noisy_vision_tokens"],), float(timestep[b]), device=device)
            preds, _, _ = transformer(
                input_ids=text["input_ids"],
                text_indexes=text["text_indexes"],
                position_ids=torch.cat([text["text_mrope_ids"], vision["vision_mrope_ids"]], dim=1),
                und_len=text["und_len"],
                sequence_length=text["und_len"] + vision["num_vision_tokens"],
                vision_tokens=[row],
                vision_token_shapes=vision["vision_token_shapes"],
                vision_sequence_indexes=vision["vision_sequence_indexes"],
                vision_mse_loss_indexes=vision["vision_mse_loss_indexes"],
                vision_timesteps=t,
                vision_noisy_frame_indexes=vision["vision_noisy_frame_indexes"],
                return_dict=False,
            )
            outputs.append(preds[0].reshape(row.shape))
        return torch.cat(outputs)

    # ---- the VAE (Wan2.2's), normalised as the pipeline does ----------------------------------------
    def latent_channels(self, pipe: Any) -> int:
        return int(pipe.vae.config.z_dim)

    def latent_shape(self, pipe: Any, height: int, width: int, num_frames: int = 1) -> tuple[int, ...]:
        spatial, temporal = int(pipe.vae_scale_factor_spatial), int(pipe.vae_scale_factor_temporal)
        grid = self.video_latent_grid(height, width, num_frames, spatial, temporal)
        return (self.latent_channels(pipe), *grid)

    def _stats(self, pipe: Any, like: Any) -> tuple[Any, Any]:
        shape = (1, -1, 1, 1, 1)
        mean = pipe._vae_latents_mean.to(like.device, like.dtype).view(shape)
        inv_std = pipe._vae_latents_inv_std.to(like.device, like.dtype).view(shape)
        return mean, inv_std

    def encode_images(self, pipe: Any, pixels: Any) -> Any:
        """Images [B, 3, H, W] or videos [B, 3, F, H, W] in [-1, 1] -> normalised latents [B, C, f, h, w]."""
        vae = pipe.vae
        video = pixels if pixels.dim() == 5 else pixels[:, :, None]
        z = vae.encode(video.to(vae.dtype)).latent_dist.mode()
        mean, inv_std = self._stats(pipe, z)
        return (z - mean) * inv_std

    def decode_latents(self, pipe: Any, latents: Any) -> Any:
        """Latents [B, C, f, h, w] -> videos [B, 3, F, H, W] in [0, 1] (one frame: images [B, 3, H, W])."""
        vae = pipe.vae
        z = latents.to(vae.dtype)
        mean, inv_std = self._stats(pipe, z)
        video = vae.decode(z / inv_std + mean, return_dict=False)[0]
        video = (video.float() / 2 + 0.5).clamp(0, 1)
        return video[:, :, 0] if video.shape[2] == 1 else video

    # ---- validation -----------------------------------------------------------------------------------
    def check_settings(self, res: Any, job: Any) -> None:
        super().check_settings(res, job)
        if int(res["rollout_microgroup_size"] or 1) > 1:
            res.fail(
                f"{res.show('rollout_microgroup_size')}: cosmos3's forward packs one sample at a time, so a request "
                "cannot batch samples (use 1, as the reference does)"
            )

    # ---- sglang adapter ----------------------------------------------------------------------------------
    def sglang_server_options(self, precision: str, guidance_scale: float | None = None) -> dict[str, Any]:
        """No text encoder to give a precision (the flag is left out)."""
        options = super().sglang_server_options(precision, guidance_scale)
        options["text_encoder_precisions"] = None
        return options

    def from_engine_conditions(
        self, cond_kwargs: Mapping[str, Any], env: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """sglang's Cosmos3 env carries `text_ids`, `text_mask` and `fps` verbatim: kept as float rows (a
        missing mask is all ones; a scalar fps becomes `[1]`)."""
        import torch

        rows = super().from_engine_conditions(cond_kwargs, env)
        if "text_ids" not in rows:
            raise ValueError(f"sglang's Cosmos3 denoising_env has no text_ids (keys: {sorted(cond_kwargs)})")
        ids = rows["text_ids"].reshape(-1)
        mask = rows.get("text_mask")
        fps = cond_kwargs.get("fps", (env or {}).get("fps", DEFAULT_FPS))
        fps_value = float(fps.reshape(-1)[0]) if isinstance(fps, torch.Tensor) else float(fps)
        return {
            "text_ids": ids,
            "text_mask": torch.ones_like(ids) if mask is None else mask.reshape(-1).float(),
            "fps": torch.tensor([fps_value]),
        }

    def from_engine_image(self, image: Any) -> Any:
        image = image.float()
        return image[:, 0] if image.dim() == 4 and image.shape[1] == 1 else image

    def engine_module(self, module: str) -> tuple[str, list[str]]:
        """A module of the DiT (diffusers' name) -> (the name sglang's port gives it, the diffusers modules whose
        tensors make it up, in the fused order): q/k/v -> `to_qkv`, gate/up -> `gate_up_proj`; "" for the modules
        it drops (`lm_head`, `norm`)."""
        return sglang_module(module, self.gated_mlp)

    def to_engine_tensors(self, tensors: Mapping[str, Any]) -> dict[str, Any]:
        """Named DiT tensors -> what sglang's port holds: renamed, the members of a fused module concatenated along
        dim 0 under its name (all members needed), the dropped modules left out, the token embedding's rows
        zero-padded to a multiple of `sglang_vocab_padding` (sglang's VocabParallelEmbedding)."""
        import torch

        out = super().to_engine_tensors(tensors)
        embed = "language_model.embed_tokens.weight"
        if embed in out:
            rows = int(out[embed].shape[0])
            extra = -rows % self.sglang_vocab_padding
            if extra:
                out[embed] = torch.cat([out[embed], out[embed].new_zeros(extra, *out[embed].shape[1:])])
        return out


# sglang 0.5.23's Cosmos3 module renames, per decoder layer (`layers.<i>.<suffix>`), in its mapping's order (the
# generation pathway before the understanding one): diffusers suffix -> (sglang's module under the layer's
# pathway, its members' suffixes when fused)
_GEN_RENAMES: dict[str, str] = {
    "self_attn.to_add_out": "cross_attention.to_out",
    "self_attn.norm_added_q": "cross_attention.norm_q",
    "self_attn.norm_added_k": "cross_attention.norm_k",
    "input_layernorm_moe_gen": "input_layernorm",
    "post_attention_layernorm_moe_gen": "post_attention_layernorm",
}
_GEN_QKV = ("self_attn.add_q_proj", "self_attn.add_k_proj", "self_attn.add_v_proj")
_UND_QKV = ("self_attn.to_q", "self_attn.to_k", "self_attn.to_v")
_TOP_RENAMES = {"embed_tokens": "language_model.embed_tokens", "vae2llm": "proj_in", "llm2vae": "proj_out"}
_DROPPED = ("lm_head", "norm")  # inherited from text pretraining; sglang's port has neither


def sglang_module(module: str, gated_mlp: bool = True) -> tuple[str, list[str]]:
    """A Cosmos3OmniTransformer module (diffusers' name, e.g. `layers.3.self_attn.add_k_proj`) -> (the name
    sglang 0.5.23's port gives it, e.g. `gen_layers.3.cross_attention.to_qkv`, and the diffusers modules fused
    there in order, e.g. `layers.3.self_attn.add_{q,k,v}_proj`); ("", [module]) for a module sglang drops."""
    if module in _DROPPED:
        return "", [module]
    if module in _TOP_RENAMES:
        return _TOP_RENAMES[module], [module]
    head, _, rest = module.partition(".")
    index, _, inner = rest.partition(".")
    if head != "layers" or not index.isdigit() or not inner:
        return module, [module]
    layer = f"layers.{index}."
    gen, und = f"gen_layers.{index}.", f"language_model.layers.{index}."
    if inner in _GEN_QKV:
        return gen + "cross_attention.to_qkv", [layer + m for m in _GEN_QKV]
    if inner in _GEN_RENAMES:
        return gen + _GEN_RENAMES[inner], [module]
    if inner.startswith("mlp_moe_gen."):
        proj = inner[len("mlp_moe_gen.") :]
        if gated_mlp and proj in ("gate_proj", "up_proj"):
            return gen + "mlp.gate_up_proj", [layer + "mlp_moe_gen.gate_proj", layer + "mlp_moe_gen.up_proj"]
        return gen + "mlp." + proj, [module]
    if inner in _UND_QKV:
        return und + "self_attn.to_qkv", [layer + m for m in _UND_QKV]
    if gated_mlp and inner in ("mlp.gate_proj", "mlp.up_proj"):
        return und + "mlp.gate_up_proj", [layer + "mlp.gate_proj", layer + "mlp.up_proj"]
    return und + inner, [module]


def _id_rows(ids: list[list[int]], fps: float) -> dict[str, Any]:
    """Token-id lists -> `text_ids` / `text_mask` `[B, L]` (float, zero past each prompt, as
    `collate_conditions` pads) and `fps` `[B, 1]`."""
    import torch

    longest = max(len(r) for r in ids)
    text = torch.zeros(len(ids), longest)
    mask = torch.zeros(len(ids), longest)
    for i, row in enumerate(ids):
        text[i, : len(row)] = torch.tensor(row, dtype=torch.float32)
        mask[i, : len(row)] = 1.0
    return {"text_ids": text, "text_mask": mask, "fps": torch.full((len(ids), 1), float(fps))}


def _dit(transformer: Any) -> Any:
    """The Cosmos3OmniTransformer inside a wrapper (peft's base model, a compiled module), else itself."""
    for attr in ("get_base_model", "_orig_mod"):
        inner = getattr(transformer, attr, None)
        if callable(inner):
            return inner()
        if inner is not None:
            return inner
    return transformer
