"""`TrainPipelineConfig`: the small per-model-family adapter the trainer and the engines share.

Torch-free at import: classes are named by dotted path strings and imported on use, so the
config validator can resolve a family before torch is loaded. A family is one subclass that
overrides class attributes (and, when needed, a method or two); `miles.models.families` keeps
the registry.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, ClassVar

from miles.core.errors import ConfigError
from miles.methods import UNCOND_GRAD_MODES
from miles.models.scheduler_grid import (
    FLOW_MATCH_EULER,
    dynamic_shift_mu,
    flow_match_euler_grid,
    live_scheduler_config,
    resolve_token_count,
)
from miles.models.sglang_adapter import SglangAdapter
from miles.utils.dotted import import_dotted


def target_components(value: Any) -> tuple[str, ...]:
    """`--update-weight-target-module` (a list or a comma-separated string; unset: the transformer) as a tuple."""
    if value is None:
        return ("transformer",)
    items = value if isinstance(value, (list, tuple)) else str(value).split(",")
    return tuple(str(p).strip() for p in items if str(p).strip())


class TrainPipelineConfig(SglangAdapter):
    """What miles needs to know about one diffusion model family.

    Attributes (class-level; a family overrides them):
      name: the registry key (`--diffusion-model-family`).
      hf_ckpt_name_patterns: lower-case substrings of a `--hf-checkpoint` name that select this family.
      pipeline_class / transformer_class: diffusers classes as dotted paths (imported lazily).
      transformer_subfolder: where the trained DiT lives inside the pipeline directory.
      lora_target_modules: default PEFT targets (`--lora-target-modules` overrides them).
      condition_inputs: the DiT forward's condition kwargs, as carried in a sample's cond dicts.
      weight_sync_targets: pipeline components pushed to the engines after an optimizer step.
      trainable: False for families registered for name resolution but without a training path yet.
      supports_cfg_training / cfg_batching: CFG in the training forward; pos and neg in one batch.
      input_dtype_policy: boundary casts {"latents", "cond", "timestep"} -> "default"/"fp32"/"bf16"/None.
      sde_timestep_divisor: sigma = timestep / divisor for CPS (None: use the scheduler's sigmas).
      timestep_input_scale: multiply the timestep by this before the DiT forward (1/1000 for [0,1] DiTs).
      optimizer_state_allowed_missing: parameter-name fragments whose optimizer state may be absent on load.
      guidance_mode: how `--diffusion-guidance-scale` / `--diffusion-true-cfg-scale` reach the model:
          "cfg" (two branches combined at the guidance scale), "embedded" (the guidance scale is a model
          input, e.g. FLUX.1-dev; real CFG only with a true-CFG scale > 1) or "true_cfg" (two branches at the
          true-CFG scale, falling back to the guidance scale, e.g. Qwen-Image).
      pipeline_sigmas: the pipeline passes `sigmas=linspace(1, 1/n, n)` to `set_timesteps` (FLUX, Qwen-Image)
          instead of a bare step count (SD3); a dynamic-shift scheduler also gets `mu` from the token count.
      latent_patch: the DiT's spatial patch (token count = h*w / patch**2 for the dynamic shift).

    Engine hooks (`encode_prompts`, `latent_shape`, `encode_images`, `decode_latents`) and the guided
    forward (`guided_velocity`) are what the engines, the trainer, DMD2 and SFT call; a family overrides
    them instead of callers branching on the family. The sglang adapter (`SglangAdapter`, the `sglang_*`
    attributes and hooks) is what `--rollout-backend sglang` calls.
    """

    name: ClassVar[str] = "custom"
    description: ClassVar[str] = ""
    hf_ckpt_name_patterns: ClassVar[tuple[str, ...]] = ()
    pipeline_class: ClassVar[str] = "diffusers.DiffusionPipeline"
    transformer_class: ClassVar[str | None] = None
    transformer_subfolder: ClassVar[str] = "transformer"
    lora_target_modules: ClassVar[tuple[str, ...]] = ()
    condition_inputs: ClassVar[tuple[str, ...]] = ("encoder_hidden_states",)
    weight_sync_targets: ClassVar[tuple[str, ...]] = ("transformer",)
    trainable: ClassVar[bool] = True
    not_trainable_reason: ClassVar[str] = ""
    supports_cfg_training: ClassVar[bool] = True
    cfg_batching: ClassVar[bool] = False
    input_dtype_policy: ClassVar[Mapping[str, str | None]] = MappingProxyType(
        {"latents": None, "cond": None, "timestep": None}
    )
    sde_timestep_divisor: ClassVar[float | None] = None
    timestep_input_scale: ClassVar[float] = 1.0
    optimizer_state_allowed_missing: ClassVar[tuple[str, ...]] = ()
    guidance_mode: ClassVar[str] = "cfg"
    pipeline_sigmas: ClassVar[bool] = False
    latent_patch: ClassVar[int] = 2
    packs_latents: ClassVar[bool] = False  # the DiT takes 2x2-packed tokens (so h, w must be even)
    max_sequence_length: ClassVar[int] = 256  # the pipeline's own text length default (tiny builds store theirs)
    # the transformer's block lists: FSDP2 shards each block on its own (one all-gather per block; a block
    # left out is gathered with the root, all at once)
    fsdp_block_lists: ClassVar[tuple[str, ...]] = ("transformer_blocks",)
    # the denoiser's components, trained and synced by `--update-weight-target-module` (experts: more than one)
    experts: ClassVar[tuple[str, ...]] = ()
    makes_video: ClassVar[bool] = False  # `--diffusion-output-num-frames` > 1 is this family's to honour
    # condition media (image editing, image-to-video): the number of condition images a prompt row must carry
    # (min, max); (0, 0): a text-to-image/video family, which refuses rows with media
    condition_images: ClassVar[tuple[int, int]] = (0, 0)
    # `--rollout-patch-group` values this family honours on the in-process engine (group -> what it changes in
    # the engine's and the trainer's forward alike); any other group is refused (miles.config.rules.engines)
    patch_groups: ClassVar[Mapping[str, str]] = MappingProxyType({})

    # ComfyUI loads this family's LoRA files (`miles export --comfyui`) under the module names `comfyui_lora_module`
    # gives; where it cannot, `comfyui_lora` is False and `comfyui_lora_missing` says why
    comfyui_lora: ClassVar[bool] = True
    comfyui_lora_missing: ClassVar[str] = ""

    def comfyui_lora_module(self, module: str) -> str:
        """ComfyUI's name for a LoRA-wrapped module given by diffusers' adapter name (`transformer.transformer_blocks.
        0.attn.to_q`). By default the diffusers name itself, which ComfyUI maps for MMDiT (SD3), Flux and
        Qwen-Image; a family whose ComfyUI model uses the original checkpoint's names overrides this."""
        return module

    # ---- lazy class access -------------------------------------------------------------------
    def load_pipeline_class(self) -> type:
        return import_dotted(self.pipeline_class)

    def load_pipeline(self, checkpoint: Any, **kwargs: Any) -> Any:
        """The pipeline of `checkpoint` as the engine and SFT's encoder load it: `pipeline_class.from_pretrained(
        checkpoint, **kwargs)`. A family whose checkpoints need more (a component made on load) overrides it."""
        return self.load_pipeline_class().from_pretrained(checkpoint, **kwargs)

    def load_transformer_class(self) -> type:
        if self.transformer_class is None:
            raise NotImplementedError(f"family {self.name!r} names no transformer class")
        return import_dotted(self.transformer_class)

    # ---- name matching -----------------------------------------------------------------------
    @classmethod
    def match_score(cls, checkpoint_name: str) -> int:
        """Length of the longest pattern found in `checkpoint_name` (lower-cased); 0 = no match."""
        lowered = checkpoint_name.lower()
        return max((len(p) for p in cls.hf_ckpt_name_patterns if p.lower() in lowered), default=0)

    @classmethod
    def model_index_score(cls, index: Mapping[str, Any]) -> int:
        """How well a local checkpoint's `model_index.json` (a dict) names this family, for a directory whose name
        does not: 0 not at all, 1 its `_class_name` is this family's pipeline class; a family that shares its
        pipeline class with another scores what tells them apart higher (Wan2.2 TI2V's `expand_timesteps`)."""
        return 1 if cls.pipeline_class.rpartition(".")[2] == index.get("_class_name") else 0

    # ---- guidance -------------------------------------------------------------------------------
    def cfg_scale(self, guidance_scale: float, true_cfg_scale: float | None = None) -> float:
        """The scale of the two-branch (positive/negative) combine; <= 1 means one branch only."""
        if self.guidance_mode == "embedded":
            return float(true_cfg_scale) if true_cfg_scale is not None else 1.0
        if self.guidance_mode == "true_cfg" and true_cfg_scale is not None:
            return float(true_cfg_scale)
        return float(guidance_scale)

    def embedded_guidance(self, guidance_scale: float) -> float | None:
        """The guidance value fed to the model as an input (guidance-distilled models), else None."""
        return float(guidance_scale) if self.guidance_mode == "embedded" else None

    # ---- schedule --------------------------------------------------------------------------------
    def image_seq_len(self, latent_shape: tuple[int, ...]) -> int:
        """The DiT's image token count for one latent of `latent_shape` (C, [F,] h, w)."""
        count = 1
        for d in latent_shape[1:-2]:
            count *= int(d)
        return count * (int(latent_shape[-2]) // self.latent_patch) * (int(latent_shape[-1]) // self.latent_patch)

    def schedule(
        self, scheduler: Any, num_steps: int, latent_shape: tuple[int, ...], flow_shift: float | None = None
    ) -> tuple[Any, Any]:
        """`(sigmas [T+1], timesteps [T])` exactly as this family's pipeline sets its scheduler, fp32 CPU.

        `scheduler` is not modified (a copy is set). A dynamic-shift scheduler gets `mu` from the image token
        count, as the pipeline computes it; `flow_shift` (`--diffusion-flow-shift`) replaces the shift and
        turns dynamic shifting off.
        """
        import copy

        config = scheduler.config
        if flow_shift is not None:
            overrides: dict[str, Any] = {"shift": float(flow_shift)}
            if config.get("use_dynamic_shifting", False):
                overrides["use_dynamic_shifting"] = False
            scheduler = type(scheduler).from_config(config, **overrides)
        else:
            scheduler = copy.deepcopy(scheduler)
        config = scheduler.config
        kwargs: dict[str, Any] = {}
        if self.pipeline_sigmas:
            kwargs["sigmas"] = self.sigma_grid(num_steps)
        if config.get("use_dynamic_shifting", False):
            kwargs["mu"] = self.shift_mu(self.image_seq_len(latent_shape), num_steps, config)
        if "sigmas" in kwargs:
            scheduler.set_timesteps(device="cpu", **kwargs)
        else:
            scheduler.set_timesteps(num_steps, device="cpu", **kwargs)
        return scheduler_schedule(scheduler)

    def sigma_grid(self, num_steps: int) -> Any:
        """The unshifted sigmas a `pipeline_sigmas` family's pipeline passes to `set_timesteps`: `linspace(1, 1/n, n)`
        as numpy makes it in float64 (FLUX, Qwen-Image); a pipeline that builds it otherwise overrides this."""
        import numpy as np

        return np.linspace(1.0, 1.0 / num_steps, num_steps)

    def shift_mu(self, image_seq_len: int, num_steps: int, config: Mapping[str, Any]) -> float:
        """The dynamic shift `mu` the pipeline passes to its scheduler for `image_seq_len` image tokens and
        `num_steps` steps (torch-free; `schedule` and `grid_schedule` both call it). Default: linear in the token
        count between the scheduler config's base and max (FLUX.1, Qwen-Image)."""
        return dynamic_shift_mu(image_seq_len, config)

    # ---- the same schedule without torch (`miles.sampling.grid`: inspect-config and plan print it) ----------
    def grid_schedule(
        self,
        scheduler_config: Mapping[str, Any],
        num_steps: int,
        token_count: int | Callable[[], int] | None = None,
        flow_shift: float | None = None,
    ) -> tuple[list[float], list[float]]:
        """`schedule` without torch or diffusers: `(sigmas [T+1], timesteps [T])`, the fp32 values `schedule` gives
        for a scheduler built from `scheduler_config` (a `scheduler_config.json` dict; the constructor's defaults
        fill what it leaves out, as `from_pretrained` does). `token_count` is the image token count `schedule`
        reads from the latent shape (`grid_token_count`; a callable is asked only when a dynamic shift needs it).

        A family that overrides `schedule` overrides this too (`miles.sampling.grid` refuses a family that does not).
        The base class sets a FlowMatchEuler scheduler as `schedule` does; other scheduler classes raise ValueError.
        """

        config = live_scheduler_config(scheduler_config)
        if config["_class_name"] != FLOW_MATCH_EULER:
            raise ValueError(
                f"model family {self.name!r} sets a {config['_class_name']} scheduler with its own set_timesteps, "
                f"which the torch-free grid does not reproduce (it does {FLOW_MATCH_EULER})"
            )
        if flow_shift is not None:
            config["shift"] = float(flow_shift)
            if config.get("use_dynamic_shifting", False):
                config["use_dynamic_shifting"] = False
        sigmas = self.sigma_grid(num_steps) if self.pipeline_sigmas else None
        mu = None
        if config.get("use_dynamic_shifting", False):
            mu = self.shift_mu(resolve_token_count(token_count, self.name), num_steps, config)
        out_sigmas, timesteps = flow_match_euler_grid(config, num_steps, sigmas=sigmas, mu=mu)
        return [float(x) for x in out_sigmas], [float(x) for x in timesteps]

    def grid_token_count(
        self, configs: Mapping[str, Mapping[str, Any]], height: int, width: int, num_frames: int = 1
    ) -> int:
        """The image token count `schedule` reads for an output of `height` x `width` (x `num_frames`), from the
        checkpoint's component configs ({component: its config.json}), torch-free: `image_seq_len` of the latent
        shape `latent_shape` gives on `config_pipe(configs)`. ValueError for a size the family refuses."""
        return self.image_seq_len(self.latent_shape(self.config_pipe(configs), height, width, num_frames))

    def grid_experts(
        self, timesteps: Sequence[float], model_index: Mapping[str, Any] | None, scheduler_config: Mapping[str, Any]
    ) -> list[str | None]:
        """The denoiser component that runs each step of a grid (None: the family has one transformer).
        `model_index` is the checkpoint's `model_index.json` (None: not available)."""
        return [None] * len(timesteps)

    # ---- training-forward helpers --------------------------------------------------------------
    def cfg_combine(self, pos: Any, neg: Any, scale: float) -> Any:
        """Classifier-free guidance: neg + scale * (pos - neg)."""
        return neg + scale * (pos - neg)

    def guided_velocity(
        self,
        transformer: Any,
        latents: Any,
        timestep: Any,
        pos: Mapping[str, Any],
        neg: Mapping[str, Any] | None = None,
        cfg_scale: float | None = None,
        cfg_scale_2: float | None = None,
        uncond_grad: str = "full",
    ) -> Any:
        """The velocity in fp32 with this family's guidance: one forward, or (when `cfg_scale > 1`) the
        positive and negative branches, in one batch (`cfg_batching`) or two forwards, then `cfg_combine`.
        The engines, the trainer, DMD2 and SFT all call this, so their forwards are the same computation.
        `cfg_scale_2` is the second expert's scale (`--diffusion-guidance-scale-2`, families with experts).

        `uncond_grad` (`--diffusion-cfg-uncond-grad`, the trainer's guided forward): `full` backpropagates through
        both branches; `detach`, when gradients are on, runs the negative branch as its own forward under
        `torch.no_grad()` and the positive one with grad, so the combine's gradient flows through the positive
        branch only (the negative's value is the same up to float rounding of the smaller batch). Without
        gradients (a reference forward, the engines) `detach` runs what `full` runs."""
        if uncond_grad not in UNCOND_GRAD_MODES:
            raise ValueError(f"uncond_grad {uncond_grad!r}: expected one of {', '.join(UNCOND_GRAD_MODES)}")
        if cfg_scale_2 is not None and not self.experts:
            raise ValueError(f"model family {self.name!r} has one transformer: a second guidance scale has no expert")
        if cfg_scale is None or cfg_scale <= 1.0:
            return self.forward_velocity(transformer, latents, timestep, pos).float()
        if neg is None:
            raise ValueError(f"CFG at scale {cfg_scale} needs negative conditions")
        import torch

        scale = self.row_guidance(transformer, latents, timestep, cfg_scale, cfg_scale_2)
        if uncond_grad == "detach" and torch.is_grad_enabled():
            with torch.no_grad():  # the unconditional branch as a constant: no graph, no backward
                v_neg = self.forward_velocity(transformer, latents, timestep, neg).float()
            v_pos = self.forward_velocity(transformer, latents, timestep, pos).float()
        elif self.cfg_batching:
            cond = {k: torch.cat([neg[k], pos[k]]) for k in pos}
            out = self.forward_velocity(
                transformer, torch.cat([latents, latents]), torch.cat([timestep, timestep]), cond
            )
            v_neg, v_pos = out.float().chunk(2)
        else:
            v_pos = self.forward_velocity(transformer, latents, timestep, pos).float()
            v_neg = self.forward_velocity(transformer, latents, timestep, neg).float()
        return self.cfg_combine(v_pos, v_neg, scale)

    def check_uncond_grad(self, mode: str) -> None:
        """ConfigError when `mode` (`--diffusion-cfg-uncond-grad`) is not `full` and this family's `guided_velocity`
        (an override written before the flag) takes no `uncond_grad`: the trainer passes it only for other modes."""
        import inspect

        if mode == "full":
            return
        params = inspect.signature(self.guided_velocity).parameters.values()
        if any(p.name == "uncond_grad" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            return
        raise ConfigError(
            f"--diffusion-cfg-uncond-grad {mode}: model family {self.name!r} overrides guided_velocity without its "
            "uncond_grad argument (TrainPipelineConfig.guided_velocity); add it, or use full"
        )

    def row_guidance(
        self, transformer: Any, latents: Any, timestep: Any, cfg_scale: float, cfg_scale_2: float | None
    ) -> Any:
        """The CFG scale `guided_velocity` combines with: a number, or a per-row tensor broadcastable to the
        latents (a family with experts: each row at its expert's scale). Default: `cfg_scale`."""
        return float(cfg_scale)

    def collate_conditions(self, rows: list[Mapping[str, Any]]) -> dict[str, Any]:
        """Batch per-sample condition rows (each without a batch dim). Default: stack (equal shapes)."""
        import torch

        return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}

    def condition_row(self, batch: Mapping[str, Any], row: int) -> dict[str, Any]:
        """Row `row` of a batch of conditions as `encode_prompts` made it, as that prompt alone would have it
        (the inverse of `collate_conditions`). Default: the row (equal shapes, no padding)."""
        return {k: v[row] for k, v in batch.items()}

    def prepare_cond_kwargs(self, cond: Mapping[str, Any]) -> dict[str, Any]:
        """Select this family's condition inputs from a cond dict (a missing one is a KeyError)."""
        missing = [k for k in self.condition_inputs if k not in cond]
        if missing:
            raise KeyError(f"family {self.name!r}: condition inputs {missing} missing (have {sorted(cond)})")
        return {k: cond[k] for k in self.condition_inputs}

    def forward_velocity(self, transformer: Any, latents: Any, timestep: Any, cond: Mapping[str, Any]) -> Any:
        """The DiT's flow prediction for `latents` at `timestep` under condition `cond`."""
        t = timestep * self.timestep_input_scale if self.timestep_input_scale != 1.0 else timestep
        out = transformer(hidden_states=latents, timestep=t, return_dict=False, **self.prepare_cond_kwargs(cond))
        return out[0]

    # ---- the denoiser: one transformer, or experts (Wan2.2) -----------------------------------------
    def denoiser(self, pipe: Any) -> Any:
        """The module the engines denoise with (`guided_velocity`'s `transformer`) and sync weights into: the
        pipeline's transformer; a family with experts returns one module holding them (names prefixed by
        component). Its state-dict names are the ones the trainer's module has."""
        return pipe.transformer

    def load_denoiser(self, checkpoint: Any, dtype: Any, components: tuple[str, ...] = ("transformer",)) -> Any:
        """The trainer's module: `components` (`--update-weight-target-module`) loaded from `checkpoint` in
        `dtype`, with the same state-dict names as `denoiser(pipe)`'s for those components."""
        import os

        from miles.models.loading import quiet_loading

        with quiet_loading():
            return self.load_transformer_class().from_pretrained(
                os.fspath(checkpoint), subfolder=self.transformer_subfolder, dtype=dtype
            )

    def split_denoiser_state(self, state: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
        """A denoiser state dict -> {pipeline subfolder: that component's state} (for exports)."""
        return {self.transformer_subfolder: dict(state)}

    def denoiser_components(self, components: tuple[str, ...] = ("transformer",)) -> tuple[str, ...]:
        """The pipeline subfolders `load_denoiser(..., components)` loads: the experts named in `components`
        (`--update-weight-target-module`), else the one transformer."""
        if self.experts:
            return tuple(name for name in self.experts if name in components)
        return (self.transformer_subfolder,)

    def compose_denoiser(self, modules: Mapping[str, Any]) -> Any:
        """The trainer's module from components already built ({subfolder: module}, e.g. on the meta device for
        memory estimates): what `load_denoiser` returns, without loading. Default: the one transformer."""
        return modules[self.transformer_subfolder]

    def trainable_sigma_range(self, components: tuple[str, ...]) -> tuple[float, float] | None:
        """The sigmas the trained `components` denoise, as [lo, hi) (None: all): SFT and NFT draw their noise
        levels inside it when only some experts train."""
        return None

    def bind_args(self, args: Any) -> None:
        """Read the run settings the forward depends on (e.g. `--rollout-patch-group`, `--diffusion-fps`); the
        engine and the trainer both call it on their own instance. Default: nothing."""

    def sde_mask(self, latent_shape: tuple[int, ...]) -> Any:
        """A bool tensor of `latent_shape` (one sample): True where the SDE step is stochastic and scored, False
        where the element takes the ODE mean and is left out of the log-prob (e.g. LTX-2's audio stream). The
        engine and the trainer pass it to the step. Default None: every element is stochastic."""
        return None

    def data_mask(self, latent_shape: tuple[int, ...]) -> Any:
        """A bool tensor of `latent_shape` (one sample): True where `encode_images` latents carry data, so the SFT
        loss reads only those elements (e.g. LTX-2's video stream: image data has no audio). Default None: all."""
        return None

    def generated_mask(self, latent_shape: tuple[int, ...]) -> Any:
        """A bool tensor of `latent_shape` (one sample): True where the family generates the latent element, False
        where the condition fixes it (e.g. Wan2.2 TI2V's latent frame 0, the condition image's latents at timestep
        0). The elements it leaves out are no part of the sample's distribution: the step keeps them (the family's
        velocity is 0 there and `hold_latents` sets them), and every log-prob, KL and loss leaves them out
        (`step_mask`, `loss_mask`, NFT). Default None: every element is generated."""
        return None

    def step_mask(self, latent_shape: tuple[int, ...]) -> Any:
        """The mask the engine's SDE step and the trainer's recompute pass to the step: `sde_mask` and
        `generated_mask` together (None when both are None: the step as without a mask)."""
        return both_masks(self.sde_mask(latent_shape), self.generated_mask(latent_shape))

    def loss_mask(self, latent_shape: tuple[int, ...]) -> Any:
        """The elements a data loss reads (SFT, DPO): `data_mask` and `generated_mask` together (None: all)."""
        return both_masks(self.data_mask(latent_shape), self.generated_mask(latent_shape))

    def hold_latents(self, latents: Any, cond: Mapping[str, Any]) -> Any:
        """The engine's initial latents `[B, *latent_shape]` with the elements `generated_mask` leaves out set from
        the condition `cond` (the batch's positive cond dict), which the steps then keep. Default: unchanged."""
        return latents

    def bind_checkpoint(self, checkpoint: Any) -> None:
        """Read what the family needs from a local checkpoint beyond its name (e.g. Wan2.2's expert boundary)
        before `trainable_steps`; default: nothing."""

    def trainable_steps(self, sigmas: Any, timesteps: Any, components: tuple[str, ...]) -> list[int] | None:
        """The denoising steps whose transitions the trained `components` make (None: every step). A family with
        experts confines step strategies to them when only some experts train."""
        return None

    # ---- engine hooks: the VAE side (an AutoencoderKL with shift/scale by default) ---------------
    def latent_channels(self, pipe: Any) -> int:
        return int(pipe.transformer.config.in_channels)

    def video_latent_grid(
        self, height: int, width: int, num_frames: int, spatial: int, temporal: int, size_multiple: int | None = None
    ) -> tuple[int, int, int]:
        """The latent grid (f, h, w) of a video VAE that compresses `spatial` x `spatial` pixels and `temporal` frames
        into one latent cell (the first frame alone): f = (frames - 1) / temporal + 1. ValueError naming the flags
        unless the size is a multiple of `size_multiple` (default `spatial`; e.g. whole patches of cells) and the
        frame count is 1 + a multiple of `temporal` (the video families' `latent_shape` and grid read it)."""
        multiple = spatial if size_multiple is None else size_multiple
        if height % multiple or width % multiple:
            raise ValueError(
                f"--diffusion-height/--diffusion-width must be multiples of {multiple} for model family "
                f"{self.name!r}, got {height}x{width}"
            )
        if num_frames < 1 or (num_frames - 1) % temporal:
            raise ValueError(
                f"--diffusion-output-num-frames {num_frames}: model family {self.name!r} needs 1 + a multiple of "
                f"{temporal} frames (the VAE's temporal factor), e.g. {temporal + 1} or {4 * temporal + 1}"
            )
        return (num_frames - 1) // temporal + 1, height // spatial, width // spatial

    def latent_shape(self, pipe: Any, height: int, width: int, num_frames: int = 1) -> tuple[int, ...]:
        """The natural-layout shape (C, h, w) of one latent for an image of `height` x `width` (a video
        family: (C, f, h, w) for `num_frames` frames)."""
        if num_frames != 1:
            raise ValueError(
                f"--diffusion-output-num-frames {num_frames}: model family {self.name!r} makes images (use 1)"
            )
        factor = pipe.vae_scale_factor * (self.latent_patch if self.packs_latents else 1)
        if height % factor or width % factor:
            raise ValueError(
                f"--diffusion-height/--diffusion-width must be multiples of {factor} for model family "
                f"{self.name!r}, got {height}x{width}"
            )
        return (self.latent_channels(pipe), height // pipe.vae_scale_factor, width // pipe.vae_scale_factor)

    # ---- memory before launch: one micro-batch's tensors from the component configs alone -------------
    def config_pipe(self, configs: Mapping[str, Mapping[str, Any]]) -> Any:
        """A stand-in for the pipeline with only what `latent_shape` reads, from the checkpoint's component
        configs ({component: its config.json}): each component as `.config`, and the VAE's scale factor as the
        pipeline computes it. Default: an AutoencoderKL (2 ** (number of VAE blocks - 1))."""
        from types import SimpleNamespace

        pipe = SimpleNamespace(
            **{name: SimpleNamespace(config=SimpleNamespace(**cfg)) for name, cfg in configs.items()}
        )
        blocks = configs.get("vae", {}).get("block_out_channels", [0, 0, 0, 0])
        pipe.vae_scale_factor = 2 ** (len(blocks) - 1)
        return pipe

    def example_conditions(
        self, configs: Mapping[str, Mapping[str, Any]], text_length: int
    ) -> dict[str, tuple[tuple[int, ...], str | None]]:
        """{condition input: (shape of one sample's tensor, dtype)} as `encode_prompts` makes them at `text_length`
        tokens, from the component configs alone (dtype None: the text encoder's, i.e. the forward dtype; shape
        None: the input is passed as None, which `forward_velocity` must accept). The
        memory plan traces the training forward on these (`miles.memory.activations`); a family without it gets
        no activation estimate."""
        raise NotImplementedError(f"model family {self.name!r} does not describe its conditions (example_conditions)")

    def example_media_conditions(
        self, latent_shape: tuple[int, ...], pipe: Any = None
    ) -> dict[str, tuple[tuple[int, ...], str | None]]:
        """The condition inputs `encode_media` adds, as `example_conditions` describes its own, for a sample of
        `latent_shape` (one sample, no batch dimension): the memory plan's case. `pipe`: the plan's `config_pipe`
        with the checkpoint as `name_or_path`, for a family whose sources' size is the checkpoint's (e.g.
        qwen_image_edit's VAE copy at ~1 MP whatever the output's size). Default: none."""
        return {}

    def encode_media(self, pipe: Any, images: list[Any], height: int, width: int) -> dict[str, Any]:
        """The condition inputs one prompt's condition images give (PIL images in the row's order, for an output of
        `height` x `width`): tensors with a leading batch dimension of 1, added to both branches' cond dicts and
        recorded with the sample, so the trainer's forward sees exactly the engine's. Families with
        `condition_images` (0, 0) are never called."""
        raise NotImplementedError(f"model family {self.name!r} takes no condition images")

    def condition_media(
        self,
        pipe: Any,
        images: list[Any],
        height: int,
        width: int,
        prompts: tuple[str, str | None],
        pos: Mapping[str, Any],
        neg: Mapping[str, Any] | None,
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """One prompt row's conditions with its condition images in them: `pos` / `neg` are the row's conditions as
        `encode_prompts` made them for `prompts` = (the prompt, the negative prompt or None), one row without a batch
        dimension (`condition_row`; `neg` None without CFG). The engine and SFT's encoder call this once per row.
        Default: `encode_media`'s inputs added to both branches. A family whose text condition reads the images
        (Qwen-Image-Edit's vision-language encoder) encodes its text again here, with them."""
        media = {k: v[0] for k, v in self.encode_media(pipe, images, height, width).items()}
        return {**pos, **media}, (None if neg is None else {**neg, **media})

    def encode_images(self, pipe: Any, pixels: Any) -> Any:
        """Images [B, 3, H, W] in [-1, 1] -> normalised latents [B, C, h, w] (the posterior mean)."""
        vae = pipe.vae
        z = vae.encode(pixels.to(vae.dtype)).latent_dist.mean
        return (z - vae.config.shift_factor) * vae.config.scaling_factor

    def decode_latents(self, pipe: Any, latents: Any) -> Any:
        """Final latents [B, C, h, w] -> images [B, 3, H, W] in [0, 1], fp32 (the VAE's own shift/scale)."""
        vae = pipe.vae
        z = latents.to(vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
        image = vae.decode(z, return_dict=False)[0]
        return (image.float() / 2 + 0.5).clamp(0, 1)

    # ---- training-side parallelism and attention (import torch only when called) ---------------
    def enable_sequence_parallel(self, model: Any, group: Any) -> None:
        """Shard `model`'s token sequence over the ranks of the process group `group` (`--sequence-parallel-size`).

        Contract: every rank of `group` is given the same inputs and returns the whole output; every
        cross-rank step is autograd-aware with the exact adjoint as its backward, so a rank's parameter
        gradients are its partial sums and their sum over `group` is the gradient of the sum of the ranks'
        losses. A family without a sequence-parallel plan refuses.
        """
        raise ConfigError(
            f"--sequence-parallel-size: model family {self.name!r} has no sequence-parallel plan in miles; "
            "use --sequence-parallel-size 1"
        )

    def set_attention_backend(self, model: Any, backend: str) -> None:
        """Run `model`'s attention on diffusers' attention backend `backend` (`--fsdp-attention-backend`).

        The default is diffusers' own `set_attention_backend`, which reaches the processors that dispatch
        through `dispatch_attention_fn`; a family whose processors call a kernel directly overrides it.
        """
        model.set_attention_backend(backend)

    # ---- validation --------------------------------------------------------------------------
    def check_settings(self, res: Any, job: Any) -> None:
        """This family's rules on the resolved flags (`miles.config.resolution.Resolution`): `res.fail(...)`
        for a setting it cannot honour. The base refuses a true-CFG scale where guidance is plain CFG."""
        if res["diffusion_true_cfg_scale"] is not None and self.guidance_mode == "cfg":
            res.fail(
                f"{res.show('diffusion_true_cfg_scale')}: model family {self.name!r} has plain CFG "
                "(set --diffusion-guidance-scale); a true-CFG scale is for flux (real CFG beside its embedded "
                "guidance) and qwen_image"
            )
        self._check_video_and_experts(res)
        if self.condition_images != (0, 0):
            self._check_conditioned_job(res, job)
        if job.trains_on_rollouts and res["diffusion_cfg_uncond_grad"] != "full":
            self._check_cfg_uncond_grad(res)

    def _check_cfg_uncond_grad(self, res: Any) -> None:
        """`--diffusion-cfg-uncond-grad detach` needs an unconditional branch in the trained forward: CFG in
        training (`supports_cfg_training`) at a two-branch scale above 1 (`cfg_scale`); a guidance-distilled family
        (`guidance_mode` "embedded") has one only under a true-CFG scale. A recipe's value falls back to full with a
        warning where it does not apply (`Resolution.not_applicable`)."""
        dest = "diffusion_cfg_uncond_grad"
        guidance, true_cfg = float(res["diffusion_guidance_scale"]), res["diffusion_true_cfg_scale"]
        if not self.supports_cfg_training:
            res.not_applicable(
                dest,
                f"model family {self.name!r} trains without CFG, so its trained forward has no unconditional branch "
                "to detach",
            )
            return
        if self.cfg_scale(guidance, true_cfg) > 1.0:
            return
        if self.guidance_mode == "embedded" and true_cfg is None:
            res.not_applicable(
                dest,
                f"model family {self.name!r} takes {res.show('diffusion_guidance_scale')} as a model input "
                "(guidance-distilled, one branch), so its trained forward has no unconditional branch to detach",
                "true CFG needs --diffusion-true-cfg-scale > 1",
            )
            return
        scale = "diffusion_true_cfg_scale" if true_cfg is not None else "diffusion_guidance_scale"
        res.not_applicable(
            dest,
            f"CFG is off in training ({res.show(scale)}, at most 1), so the trained forward has no unconditional "
            "branch to detach",
        )

    def _check_conditioned_job(self, res: Any, job: Any) -> None:
        """What an edit / image-to-video family does not run yet: DMD2 (its few-step student samples from text
        alone) and offline DPO on preference rows (their sources are not encoded into the pairs' conditions)."""
        from miles.methods import METHODS

        if job.distills:
            res.fail(
                f"`miles {job.command}`: model family {self.name!r} takes condition images, and miles' DMD2 samples "
                "its student from text alone; distil a text-to-image family, or train this one with `train rl` / "
                "`train sft`"
            )
        known = METHODS.get(res["loss_type"])
        if job.trains_on_dataset and known is not None and known.sft_rows == "preference":
            res.fail(
                f"{res.show('loss_type')}: offline DPO on preference rows does not encode their condition images "
                f"yet, which model family {self.name!r} needs; use online DPO (`train rl --loss-type dpo`)"
            )

    def _check_video_and_experts(self, res: Any) -> None:
        """Frames, fps and frame stride only for a video family; a second guidance scale only with experts;
        `--update-weight-target-module` names this family's components."""
        frames = int(res["diffusion_output_num_frames"] or 1)
        if frames < 1:
            res.fail(f"{res.show('diffusion_output_num_frames')}: the number of frames must be >= 1")
        elif frames > 1 and not self.makes_video:
            res.fail(
                f"{res.show('diffusion_output_num_frames')}: model family {self.name!r} makes images (use 1); "
                "frames are for video families such as wan2_2"
            )
        if res["diffusion_fps"] is not None and (frames == 1 or not self.makes_video):
            res.fail(f"{res.show('diffusion_fps')}: the frame rate is for videos (--diffusion-output-num-frames > 1)")
        stride = res["sft_frame_stride"]
        if stride is not None and int(stride) < 1:
            res.fail(f"{res.show('sft_frame_stride')}: the frame stride must be >= 1")
        elif stride is not None and int(stride) != 1 and not self.makes_video:
            res.fail(f"{res.show('sft_frame_stride')}: model family {self.name!r} trains on images (frame stride 1)")
        if res["diffusion_guidance_scale_2"] is not None and not self.experts:
            res.fail(
                f"{res.show('diffusion_guidance_scale_2')}: model family {self.name!r} has one transformer; the "
                "second guidance scale is for the low-noise expert of wan2_2"
            )
        value = res["update_weight_target_module"]
        if value is not None:
            items = value if isinstance(value, (list, tuple)) else str(value).split(",")
            parts = [str(p).strip() for p in items]
            allowed = self.experts or (self.transformer_subfolder,)
            bad = [p for p in parts if p not in allowed]
            if bad or not parts or len(set(parts)) != len(parts):
                res.fail(
                    f"{res.show('update_weight_target_module')}: model family {self.name!r} trains and syncs "
                    f"{', '.join(allowed)} (comma-separated, each once)"
                )

    def check_trainable(self, selected_by: str, trainable_families: tuple[str, ...] = ()) -> None:
        """Raise ConfigError (naming `selected_by`, e.g. the flag) when this family has no training path yet."""
        if not self.trainable:
            reason = f" ({self.not_trainable_reason})" if self.not_trainable_reason else ""
            known = f"; trainable families: {', '.join(trainable_families)}" if trainable_families else ""
            raise ConfigError(
                f"{selected_by}: model family {self.name!r} is registered but not trainable in miles yet"
                f"{reason}{known}"
            )

    def summary(self) -> dict[str, Any]:
        """A JSON-friendly view, e.g. for `inspect-config`."""
        return {
            "name": self.name,
            "class": f"{type(self).__module__}.{type(self).__qualname__}",
            "pipeline_class": self.pipeline_class,
            "transformer_class": self.transformer_class,
            "lora_target_modules": list(self.lora_target_modules),
            "condition_inputs": list(self.condition_inputs),
            "weight_sync_targets": list(self.weight_sync_targets),
            "guidance_mode": self.guidance_mode,
            "cfg_batching": self.cfg_batching,
            "trainable": self.trainable,
        }

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def both_masks(a: Any, b: Any) -> Any:
    """The elementwise AND of two optional bool masks (None: all True)."""
    if a is None:
        return b
    if b is None:
        return a
    return a & b.to(a.device)


def scheduler_schedule(scheduler: Any) -> tuple[Any, Any]:
    """`(sigmas [T+1], timesteps [T])` of a live diffusers-style scheduler after `set_timesteps`, fp32 CPU copies.

    Duck-typed (anything with `.sigmas` and `.timesteps`), so nothing here imports diffusers.
    Prefer these stored values over recomputing sigmas from timesteps / 1000, which drifts by ULPs.
    """
    import torch

    sigmas = torch.as_tensor(scheduler.sigmas).detach().to("cpu", torch.float32).clone()
    timesteps = torch.as_tensor(scheduler.timesteps).detach().to("cpu", torch.float32).clone()
    if sigmas.ndim != 1 or timesteps.ndim != 1 or sigmas.shape[0] != timesteps.shape[0] + 1:
        raise ValueError(
            f"expected sigmas [T+1] and timesteps [T], got {tuple(sigmas.shape)} and {tuple(timesteps.shape)}; "
            "call scheduler.set_timesteps first"
        )
    return sigmas, timesteps


def prompt_geometry(args: Any) -> dict[str, Any]:
    """The output geometry `encode_prompts` receives (`geometry=`): size, frame count and fps from the flags
    (a family whose prompt template states them, e.g. cosmos3, reads it; the others ignore it)."""
    return {
        "height": int(args.diffusion_height),
        "width": int(args.diffusion_width),
        "num_frames": int(args.diffusion_output_num_frames or 1),
        "fps": args.diffusion_fps,
    }
