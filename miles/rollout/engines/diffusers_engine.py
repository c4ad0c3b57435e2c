"""The in-process diffusers engine: one pipeline, loaded from `--hf-checkpoint`, sampling trajectories.

It runs on CPU or GPU, directly or as a Ray actor (`EngineActor`). A request is one microgroup: one
prompt, encoded once, M samples with consecutive seeds. The denoising loop is the pipeline's own
(same scheduler, same CFG, same transformer call) with the step replaced by `miles.sampling.sde.sde_step`
on the steps the step strategy chose, so with noise level 0 it reproduces the plain pipeline.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from miles.core.inputs import input_path
from miles.core.packed import Packed
from miles.core.sample import Conditions, Sample, Trajectory
from miles.models.families import resolve_family
from miles.models.loading import quiet_loading
from miles.models.lora_sync import LoraMerger, is_lora_entry
from miles.models.tiny.metadata import max_sequence_length
from miles.rollout.engines.base import GenerateRequest
from miles.rollout.engines.engine_state import HEALTH_GROUP, RecoverableEngine
from miles.sampling.ode_solvers import compress_after, data_prediction, dpmpp_2m_step
from miles.sampling.plan import SamplingPlan
from miles.sampling.sde import sde_step
from miles.sampling.sde_backends import backend_step
from miles.sampling.seeds import draw_normal, generator_device, noise_generator
from miles.utils.offload import own_memory

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def eval_batches(
    requests: list[GenerateRequest], max_samples: int, max_train_samples: int = 0
) -> list[list[GenerateRequest]]:
    """The engine's forward batches, requests in order: consecutive evaluation requests that agree on everything
    but prompt and seeds share a batch of at most `max_samples` samples (ODE, nothing recorded per step);
    consecutive training microgroups that agree alike share one of at most `max_train_samples`
    (--rollout-engine-batch-size; 0: each alone), unless a microgroup runs its own schedule (a shared prefix,
    a compressed tail). Every sample keeps its own seeds, SDE steps and prompt."""
    batches: list[list[GenerateRequest]] = []
    for req in requests:
        last = batches[-1] if batches else None
        limit = max_samples if req.evaluation else max_train_samples
        if (
            last is not None
            and _joinable(req)
            and _joinable(last[0])
            and req.evaluation == last[0].evaluation
            and _batch_key(req) == _batch_key(last[0])
            and req.extra == last[0].extra
            and sum(len(r.seeds) for r in last) + len(req.seeds) <= max(1, limit)
        ):
            last.append(req)
        else:
            batches.append([req])
    return batches


def _joinable(req: GenerateRequest) -> bool:
    """A training microgroup with a schedule of its own (one shared prefix, a tail compressed after its window)
    runs alone."""
    return req.evaluation or (not req.shared_prefix and req.post_sde_steps_ratio is None)


def forward_batch_sizes(args: Any) -> tuple[int, int]:
    """(evaluation samples, training samples) per engine forward: --rollout-microgroup-size for evaluation,
    --rollout-engine-batch-size for training microgroups (unset: each alone)."""
    return int(args.rollout_microgroup_size), int(getattr(args, "rollout_engine_batch_size", None) or 0)


def _batch_key(req: GenerateRequest) -> tuple[Any, ...]:
    return (
        req.num_steps,
        req.height,
        req.width,
        req.guidance_scale,
        req.true_cfg_scale,
        req.negative_prompt,
        req.noise_level,
        req.sde_type,
        req.num_frames,
        req.guidance_scale_2,
        req.debug,
        req.record_means,
        req.ode_solver,
    )


class DiffusersEngine:
    """Samples denoising trajectories with exact per-step log-probs from a diffusers pipeline."""

    def __init__(self, args: Any, device: str | None = None) -> None:
        self.args = args
        self.family = resolve_family(
            args.hf_checkpoint,
            family=args.diffusion_model_family,
            config_path=args.train_pipeline_config_path,
            require_trainable=False,
        )
        self.family.bind_args(args)  # run settings the forward reads (e.g. --rollout-patch-group)
        self.checkpoint = input_path(args, args.hf_checkpoint)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        # initial and SDE noise are drawn by per-sample generators on --diffusion-generator-device
        self.generator_device = generator_device(args.diffusion_generator_device, self.device)
        self.dtype = DTYPES[args.diffusion_forward_dtype]
        with quiet_loading():
            self.pipe = self.family.load_pipeline(self.checkpoint, dtype=self.dtype)
        if self.dtype != torch.float32:
            self.pipe.vae.to(torch.float32)  # decode in fp32: rewards read the image
        self.pipe.to(self.device)
        # weights in torch's own memory (not the checkpoint's mmap): offload needs it, and the numbers must
        # not depend on whether an offload round trip has happened
        own_memory(m for m in self.pipe.components.values() if isinstance(m, torch.nn.Module))
        self.pipe.set_progress_bar_config(disable=True)
        self.max_sequence_length = max_sequence_length(self.checkpoint, default=self.family.max_sequence_length)
        self.weight_version = 0
        self.lora_merger = LoraMerger()  # base copies for LoRA-only sync (--lora-ipc-weight-sync)
        self._guest: tuple[str, DiffusersEngine] | None = None
        self._offloader: Any = None
        self._denoiser = self.family.denoiser(self.pipe)  # the transformer, or the experts as one module

    # ---- weights --------------------------------------------------------------------------------
    @property
    def transformer(self) -> torch.nn.Module:
        """What the engine denoises with and syncs weights into (`TrainPipelineConfig.denoiser`)."""
        return self._denoiser

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int | None = None) -> int:
        """Load (a subset of) the transformer's weights, and merge LoRA entries (`<module>.lora_A|lora_B|
        lora_scaling`, `miles.models.lora_sync`) into their base weights; returns the number of tensors taken."""
        lora = {k: v for k, v in state_dict.items() if is_lora_entry(k)}
        own = self.transformer.state_dict()
        unknown = [k for k in state_dict if k not in own and k not in lora]
        if unknown:
            raise KeyError(f"engine transformer has no parameters {unknown[:5]}")
        with torch.no_grad():
            for name, tensor in state_dict.items():
                if name not in lora:
                    own[name].copy_(tensor.to(own[name].device, own[name].dtype))
        self.lora_merger.forget(k for k in state_dict if k not in lora)
        if lora:
            self.lora_merger.apply(self.transformer, lora)
        self.weight_version = version if version is not None else self.weight_version + 1
        return len(state_dict)

    def update_weights_from_ipc(self, payload: bytes, version: int | None = None) -> int:
        """`update_weights` from one bucket passed by handle (`miles.models.weight_ipc`, --colocate): the
        tensors are views into the trainer's memory, read here and let go before this returns (LoRA parts
        still waiting for the rest of their module are copied)."""
        from miles.models.weight_ipc import rebuild

        taken = self.update_weights(rebuild(payload), version)
        self.lora_merger.own_pending()
        return taken

    def transformer_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().clone() for k, v in self.transformer.state_dict().items()}

    def health(self) -> bool:
        return True

    def offload(self) -> dict[str, float]:
        """Release the pipeline's weights (every module's parameters and buffers) while the trainer runs
        (--offload-rollout); `onload` brings the same bytes back before the next weight sync needs them
        (`miles.utils.offload`). The LoRA merger's base copies are in host memory next to GPU weights (not moved);
        on a CPU engine they move with the pipeline."""
        from miles.utils.offload import Offloader, module_tensors

        if self._offloader is None:
            self._offloader = Offloader(self.device)
        modules = [m for m in self.pipe.components.values() if isinstance(m, torch.nn.Module)]
        tensors = [*module_tensors(modules), *self.lora_merger.base.values()]
        return self._offloader.offload(tensors).as_metrics()

    def onload(self) -> dict[str, float]:
        if self._offloader is None:
            return {"bytes": 0.0, "seconds": 0.0}
        return self._offloader.onload().as_metrics()

    def placement_info(self) -> dict[str, Any]:
        """Where this engine runs (inside a Ray actor): node, Ray GPU ids, CUDA_VISIBLE_DEVICES, its device."""
        from miles.placement.ray_placement import actor_placement_info

        return actor_placement_info(str(self.device))

    # ---- sampling -------------------------------------------------------------------------------
    def noise_generators(self, seeds: list[int]) -> list[torch.Generator]:
        """One generator per sample seed, on `--diffusion-generator-device`."""
        return [noise_generator(seed, self.generator_device) for seed in seeds]

    def _schedule(self, num_steps: int, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.family.schedule(self.pipe.scheduler, num_steps, shape, self.args.diffusion_flow_shift)

    @torch.no_grad()
    def generate(self, requests: list[GenerateRequest]) -> list[Sample]:
        """Run the requests in forward batches (`eval_batches`); return the completed samples in request order."""
        out: list[Sample] = []
        for batch in eval_batches(requests, *forward_batch_sizes(self.args)):
            out.extend(self._generate_microgroup(batch))
        return out

    def generate_guest(self, args: Any, requests: list[GenerateRequest]) -> list[Sample]:
        """Generate with another checkpoint (`args.hf_checkpoint`, e.g. the DMD2 teacher), loaded once into
        this engine's process and device: it shares this engine's place in the placement plan."""
        if self._guest is None or self._guest[0] != args.hf_checkpoint:
            self._guest = (args.hf_checkpoint, DiffusersEngine(args, device=str(self.device)))
        return self._guest[1].generate(requests)

    def drop_guest(self) -> None:
        self._guest = None

    def generate_few_step(self, requests: list[GenerateRequest]) -> list[Sample]:
        """The DMD2 student's few-step rollouts (`miles.rollout.dmd2.engine`), all requests as one batch."""
        from miles.rollout.dmd2.engine import generate_few_step

        return generate_few_step(self, requests)

    def _generate_microgroup(self, reqs: list[GenerateRequest]) -> list[Sample]:
        """One microgroup (a prompt's samples), or several requests batched by `eval_batches`: every row its own
        seed and SDE steps, the text conditions encoded once per prompt."""
        start = time.perf_counter()
        seeds = [seed for r in reqs for seed in r.seeds]
        conditions = self._encode_conditions(reqs, len(seeds))
        run = self._denoise(reqs, seeds, conditions)
        images = self.family.decode_latents(self.pipe, run.x.to(self.device)).float().cpu()
        return self._pack_samples(reqs, conditions, run, images, time.perf_counter() - start)

    def _encode_conditions(self, reqs: list[GenerateRequest], m: int) -> _Conditions:
        """The batch's text conditions: each prompt encoded once (the negative once for all), then one row per
        sample (`m` rows, request by request)."""
        family, req = self.family, reqs[0]  # the batch shares everything but prompts and seeds
        cfg_scale = family.cfg_scale(req.guidance_scale, req.true_cfg_scale)
        do_cfg = cfg_scale > 1.0
        pos, neg = family.encode_prompts(
            self.pipe,
            [r.prompt for r in reqs],
            req.negative_prompt,
            do_cfg,
            self.max_sequence_length,
            guidance=family.embedded_guidance(req.guidance_scale),
            geometry={"height": req.height, "width": req.width, "num_frames": req.num_frames, "fps": req.fps},
        )
        sources: list[list[torch.Tensor]] = [[] for _ in reqs]
        if family.condition_images != (0, 0):  # each prompt's condition images, in both branches
            pos, neg, sources = self._encode_media(reqs, pos, neg)
        if len(reqs) == 1:
            cond_batch = {k: v.expand(m, *v.shape[1:]) for k, v in pos.items()}
            neg_batch = {k: v.expand(m, *v.shape[1:]) for k, v in neg.items()} if neg is not None else None
        else:
            rows = torch.tensor([p for p, r in enumerate(reqs) for _ in r.seeds])
            cond_batch = {k: v[rows.to(v.device)] for k, v in pos.items()}
            neg_batch = {k: v[rows.to(v.device)] for k, v in neg.items()} if neg is not None else None
        scale_2 = req.guidance_scale_2 if do_cfg else None
        return _Conditions(pos, neg, cond_batch, neg_batch, cfg_scale, do_cfg, scale_2, sources)

    def _encode_media(
        self, reqs: list[GenerateRequest], pos: dict[str, torch.Tensor], neg: dict[str, torch.Tensor] | None
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None, list[list[torch.Tensor]]]:
        """The text conditions `pos` / `neg` (one row per request) with each request's condition images in them
        (`condition_media`, row by row, collated again), and the images as [3, H, W] in [0, 1] (what a reward that
        compares an edit with its source reads)."""
        from miles.data.media import open_condition_images

        family = self.family
        pos_rows: list[dict[str, torch.Tensor]] = []
        neg_rows: list[dict[str, torch.Tensor]] = []
        sources: list[list[torch.Tensor]] = []
        for p, r in enumerate(reqs):
            images = open_condition_images(r.media)
            row_neg = None if neg is None else family.condition_row(neg, p)
            a, b = family.condition_media(
                self.pipe,
                images,
                r.height,
                r.width,
                (r.prompt, r.negative_prompt),
                family.condition_row(pos, p),
                row_neg,
            )
            pos_rows.append(a)
            if b is not None:
                neg_rows.append(b)
            sources.append([torch.from_numpy(np.asarray(i, dtype=np.float32) / 255).permute(2, 0, 1) for i in images])
        neg_batch = None if neg is None else family.collate_conditions(neg_rows)
        return family.collate_conditions(pos_rows), neg_batch, sources

    def _denoise(self, reqs: list[GenerateRequest], seeds: list[int], conditions: _Conditions) -> _Denoised:
        """The step loop: every row from its seed's initial noise to its last latent, an SDE step (its own noise,
        its log-prob) on the row's SDE steps and an ODE step on the others (`SamplingPlan`: a shared prefix run once
        until it branches, DPM-Solver++ 2M and a compressed schedule after the SDE window)."""
        family, req, m = self.family, reqs[0], len(seeds)
        cfg_scale, scale_2 = conditions.cfg_scale, conditions.scale_2
        shape = family.latent_shape(self.pipe, req.height, req.width, req.num_frames)
        sde_sets = [set(steps) for r in reqs for steps in r.sde_steps]
        stochastic = req.noise_level > 0 and req.sde_type != "ode"
        plan = SamplingPlan.of(req, sde_sets if stochastic else [set() for _ in sde_sets])
        sigmas, timesteps = self._schedule(req.num_steps, shape)
        if plan.compress_after is not None:  # --diffusion-post-sde-steps-ratio (MixGRPO-Flash)
            sigmas, timesteps = compress_after(sigmas, timesteps, plan.compress_after, float(req.post_sde_steps_ratio))
        num_steps = int(timesteps.shape[0])
        # None: every element stochastic (else e.g. LTX-2's audio by ODE, Wan2.2 TI2V's condition frame held)
        sde_mask = family.step_mask(shape)
        step_extra = {} if sde_mask is None else {"mask": sde_mask}
        ndim = len(shape)
        generators = self.noise_generators(seeds)
        # the elements the condition fixes (`generated_mask`), e.g. TI2V's latent frame 0: set once, then kept
        x = family.hold_latents(torch.stack([draw_normal(shape, g) for g in generators]), conditions.cond_batch)
        rows_now = m
        if plan.branch_at is not None:  # --diffusion-shared-prefix: the first sample's noise, the prefix run once
            x, rows_now = x[:1], 1
        record = not req.evaluation
        latents = [x] if record else []
        debug = record and (req.debug or bool(self.args.diffusion_debug_mode))
        outputs: list[torch.Tensor] = []
        log_probs: list[list[torch.Tensor]] = [[] for _ in range(m)]
        means: list[list[torch.Tensor]] = [[] for _ in range(m)]  # --diffusion-grpo-guard's behaviour means
        sigma_max = sigmas[1] if sigmas.shape[0] > 1 else sigmas[0]
        calls = 0  # denoiser evaluations (rows x steps; a CFG pair counts once)
        prev_pred: tuple[torch.Tensor, float] | None = None  # the last step's data prediction (dpmpp_2m)

        for i in range(num_steps):
            if i == plan.branch_at and rows_now < m:  # the group branches here
                x, rows_now = x.expand(m, *shape).clone(), m
            t = timesteps[i].expand(rows_now).to(self.device)
            model_in = x.to(self.device, self.dtype)
            cond = _first_rows(conditions.cond_batch, rows_now)
            neg_now = _first_rows(conditions.neg_batch, rows_now)
            v = family.guided_velocity(self.transformer, model_in, t, cond, neg_now, cfg_scale, scale_2).cpu()
            calls += rows_now
            if debug:
                outputs.append(v.float())
            rows = [b for b in range(rows_now) if i in sde_sets[b]] if stochastic else []
            if len(rows) < rows_now:
                ode = sde_step(v, x, sigmas[i], sigmas[i + 1], sde_type="ode", noise_level=0.0).prev_sample
                post = [b for b in range(rows_now) if b not in rows and plan.after_window(b, i)]
                if post and req.ode_solver == "dpmpp_2m":  # --diffusion-ode-solver after the SDE window
                    m_prev, s_prev = prev_pred if prev_pred is not None else (None, None)
                    pred = data_prediction(x, v, float(sigmas[i]))
                    dpm = dpmpp_2m_step(x, pred, float(sigmas[i]), float(sigmas[i + 1]), m_prev, s_prev)
                    ode = _rows_from(ode, dpm, post, rows_now, ndim)
            if req.ode_solver == "dpmpp_2m":  # every step's data prediction feeds the next (window steps too)
                prev_pred = (data_prediction(x, v, float(sigmas[i])), float(sigmas[i]))
            if rows:
                noise = torch.zeros_like(x)
                for b in rows:
                    noise[b] = draw_normal(shape, generators[b])
                res = backend_step(  # --sde-step-backend-path / --diffusion-log-prob-no-const (sde_backends)
                    self.args,
                    v,
                    x,
                    sigmas[i],
                    sigmas[i + 1],
                    sde_type=req.sde_type,
                    noise_level=req.noise_level,
                    sigma_max=sigma_max,
                    noise=noise,
                    **step_extra,
                )
                full = len(rows) == rows_now
                x = res.prev_sample if full else _rows_from(ode, res.prev_sample, rows, rows_now, ndim)
                assert res.log_prob is not None
                for b in rows:
                    log_probs[b].append(res.log_prob[b])
                    if req.record_means:
                        means[b].append(res.mean[b])
            else:
                x = ode
            if record:
                latents.append(x)  # every step makes a new tensor: no copy needed

        if rows_now < m:  # nothing branched (no SDE step): every sample is the shared trajectory
            x = x.expand(m, *shape)
        return _Denoised(x, shape, sigmas, timesteps, sde_sets, latents, outputs, log_probs, means, calls)

    def _pack_samples(
        self,
        reqs: list[GenerateRequest],
        conditions: _Conditions,
        run: _Denoised,
        images: torch.Tensor,
        elapsed: float,
    ) -> list[Sample]:
        """The completed samples, request by request: each row's trajectory (its own storage), its image, its
        request's text conditions and its share of the batch's time and denoiser calls."""
        req, m, shape = reqs[0], len(run.sde_sets), run.shape
        samples: list[Sample] = []
        stacked = torch.stack([lat.expand(m, *shape) for lat in run.latents], dim=1) if not req.evaluation else None
        debug_outputs = torch.stack([o.expand(m, *shape) for o in run.outputs], dim=1) if run.outputs else None
        stored_cfg = conditions.cfg_scale if conditions.do_cfg else 1.0
        # each request's own text conditions (one object its samples share); the negative is one for all
        pos, neg = conditions.pos, conditions.neg
        pos_rows = [self._condition_cpu(pos, p) for p in range(len(reqs))]
        neg_rows: list[dict[str, torch.Tensor] | None] = [None] * len(reqs)
        if neg is not None:  # one negative for all, unless each prompt's condition images are in it
            shared = None if any(conditions.sources) else {k: v[0].detach().float().cpu() for k, v in neg.items()}
            neg_rows = [shared or self._condition_cpu(neg, p) for p in range(len(reqs))]
        log_probs, means = run.log_probs, run.means
        owners = [(p, r, j) for p, r in enumerate(reqs) for j in range(len(r.seeds))]
        for b, (p, owner, j) in enumerate(owners):
            trajectory = None
            if stacked is not None:
                trajectory = Trajectory(
                    latents=stacked[b].clone(),  # its own storage: a view would pickle the whole batch
                    timesteps=run.timesteps.clone(),
                    sigmas=run.sigmas.clone(),
                    sde_step_indices=sorted(run.sde_sets[b]) if log_probs[b] else [],
                    log_probs=torch.stack(log_probs[b]) if log_probs[b] else torch.zeros(0),
                    sde_type=req.sde_type,
                    noise_level=req.noise_level,
                    debug_model_outputs=None if debug_outputs is None else debug_outputs[b].clone(),
                    sde_means=torch.stack(means[b]) if means[b] else None,
                )
            conditions_row = Conditions(pos_rows[p], neg_rows[p], stored_cfg, conditions.scale_2)
            samples.append(
                owner.sample(
                    j,
                    trajectory=trajectory,
                    conditions=None if req.evaluation else conditions_row,
                    image=images[b].clone(),
                    sources=conditions.sources[p] or None,
                    inference_time_s=elapsed / m,
                    denoiser_calls=run.calls / m,
                )
            )
        return samples

    def _condition_cpu(self, batch: dict[str, torch.Tensor], row: int) -> dict[str, torch.Tensor]:
        """Row `row` of a condition batch, on the CPU in fp32 (as samples record their conditions)."""
        return {k: v.detach().float().cpu() for k, v in self.family.condition_row(batch, row).items()}


@dataclass
class _Conditions:
    """A forward batch's text conditions: the prompts' encodings (`pos` one row per request, `neg` one for all or
    None without CFG), one row per sample of each (`cond_batch`, `neg_batch`), and the CFG scales."""

    pos: dict[str, torch.Tensor]
    neg: dict[str, torch.Tensor] | None
    cond_batch: dict[str, torch.Tensor]
    neg_batch: dict[str, torch.Tensor] | None
    cfg_scale: float
    do_cfg: bool
    scale_2: float | None
    sources: list[list[torch.Tensor]]  # each request's condition images, [3, H, W] in [0, 1] (empty: none)


@dataclass
class _Denoised:
    """What the step loop made: the last latents `x` (one row per sample), the recorded latents of every step
    (training), the velocities (--diffusion-debug-mode), each row's SDE log-probs and means, the schedule it ran and
    the denoiser calls it cost."""

    x: torch.Tensor
    shape: tuple[int, ...]
    sigmas: torch.Tensor
    timesteps: torch.Tensor
    sde_sets: list[set[int]]
    latents: list[torch.Tensor]
    outputs: list[torch.Tensor]
    log_probs: list[list[torch.Tensor]]
    means: list[list[torch.Tensor]]
    calls: int


def _first_rows(batch: dict[str, torch.Tensor] | None, rows: int) -> dict[str, torch.Tensor] | None:
    """The first `rows` rows of a batch of condition tensors (a shared prefix runs one row)."""
    if batch is None:
        return None
    return {k: v[:rows] for k, v in batch.items()}


def _rows_from(base: torch.Tensor, other: torch.Tensor, rows: list[int], batch: int, latent_dims: int) -> torch.Tensor:
    """`base` with the rows `rows` taken from `other`."""
    mask = torch.zeros(batch, dtype=torch.bool)
    mask[rows] = True
    return torch.where(mask.view(-1, *([1] * latent_dims)), other, base)


class _EngineActor(RecoverableEngine, DiffusersEngine):
    """The engine inside a Ray actor. Ray starts a zero-CPU actor with one intra-op thread; on a CPU
    machine generation and training take turns, so the engine takes every core while it runs (as
    the trainer actors do). Its "health" concurrency group answers health checks while it generates
    (`miles.rollout.engines.engine_state`); the constructor and every other method run on one thread of the
    actor's own (`miles.utils.compute_thread`: one OpenMP pool, not two taking turns)."""

    def __init__(self, args: Any, device: str | None = None) -> None:
        import os

        from miles.utils.torch_threads import use_threads

        if not torch.cuda.is_available():
            use_threads(max(1, os.cpu_count() or 1))
        super().__init__(args, device)

    # samples leave the actor packed (`miles.core.packed`: a few stacked tensors, not a pickle per tensor)
    def generate(self, requests: list[GenerateRequest]) -> Any:
        return Packed(super().generate(requests))

    def generate_guest(self, args: Any, requests: list[GenerateRequest]) -> Any:
        return Packed(super().generate_guest(args, requests))

    def generate_few_step(self, requests: list[GenerateRequest]) -> Any:
        return Packed(super().generate_few_step(requests))


def engine_actor_class() -> Any:
    """The engine as a Ray actor class (Ray is imported only here)."""
    from miles.utils.actors import owned_remote
    from miles.utils.compute_thread import run_on_own_thread

    actor = run_on_own_thread(_EngineActor, elsewhere=("status", "simulate_crash"))
    return owned_remote(actor, concurrency_groups={HEALTH_GROUP: 1})
