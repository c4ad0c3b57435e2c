"""The DMD2 student's rollouts on the in-process diffusers engine (`DiffusersEngine.generate_few_step`).

Requests carry the student's timesteps in `extra` (see `few_step_request`). All requests of a call
run as one batch (in chunks of `MAX_BATCH`), prompts encoded once each per engine (cached), the
student without CFG. Each sample's noise (the initial noise and every fresh re-noising draw) comes
from its own generator seeded with its seed, so a sample is reproducible on its own.

`stop_at = k` (training, backward simulation): no image; the sample's trajectory is the student's
stopped run, in the rollout data contract's layout::

    latents   [k + 2, C, h, w]  x_{t_0} .. x_{t_k}, then x0_k (the engine's own student output at step k)
    timesteps [k + 1]           t_0 .. t_k            (the generator input is latents[-2] at timesteps[-1])
    sigmas    [k + 2]           t_0/1000 .. t_k/1000, then 0

and its conditions hold the negative prompt's encoding too when `negative` is set (the teacher's CFG).
`stop_at = None` (evaluation): the full n-step sample, decoded; no trajectory.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from miles.core.sample import Conditions, Sample, Trajectory
from miles.models.pipeline_config import prompt_geometry
from miles.rollout.dmd2.sampler import backward_simulate, few_step_sample, x0_at
from miles.rollout.engines.base import GenerateRequest
from miles.sampling.seeds import draw_normal

MAX_BATCH = 256
FEW_STEP_SDE_TYPE = "dmd2_few_step"


def few_step_request(
    prompt: str,
    metadata: dict[str, Any],
    group_index: int,
    indices: list[int],
    seeds: list[int],
    *,
    timesteps: Sequence[int],
    stop_at: int | None,
    negative: bool,
    height: int,
    width: int,
    negative_prompt: str | None = None,
) -> GenerateRequest:
    """A request for `generate_few_step`: the student at `timesteps`, stopped at `stop_at` (None: run to the end)."""
    return GenerateRequest(
        prompt=prompt,
        metadata=metadata,
        group_index=group_index,
        indices=indices,
        seeds=seeds,
        sde_steps=[[] for _ in seeds],
        num_steps=len(timesteps),
        guidance_scale=1.0,
        noise_level=0.0,
        sde_type="ode",
        height=height,
        width=width,
        negative_prompt=negative_prompt,
        evaluation=stop_at is None,
        extra={"student_timesteps": [int(t) for t in timesteps], "stop_at": stop_at, "negative": bool(negative)},
    )


def _conditions(engine: Any, prompt: str, negative_prompt: str | None, negative: bool) -> Conditions:
    cache: dict[tuple, Conditions] = engine.__dict__.setdefault("_few_step_conditions", {})
    key = (prompt, negative_prompt, negative)
    if key not in cache:
        family = engine.family
        pos, neg = family.encode_prompts(
            engine.pipe,
            [prompt],
            negative_prompt,
            negative,
            engine.max_sequence_length,
            guidance=family.embedded_guidance(engine.args.diffusion_guidance_scale),
            geometry=prompt_geometry(engine.args),
        )
        cache[key] = Conditions(
            {k: v[0].detach().float().cpu() for k, v in pos.items()},
            {k: v[0].detach().float().cpu() for k, v in neg.items()} if neg is not None else None,
            1.0,
        )
    return cache[key]


@torch.no_grad()
def generate_few_step(engine: Any, requests: list[GenerateRequest]) -> list[Sample]:
    """Run every request's samples through the student's few-step sampler; samples in request order."""
    rows = [(req, b) for req in requests for b in range(len(req.seeds))]
    out: list[Sample] = []
    for start in range(0, len(rows), MAX_BATCH):
        out.extend(_run_batch(engine, rows[start : start + MAX_BATCH]))
    return out


def _run_batch(engine: Any, rows: list[tuple[GenerateRequest, int]]) -> list[Sample]:
    start = time.perf_counter()
    first = rows[0][0]
    timesteps = list(first.extra["student_timesteps"])
    stop_at = first.extra["stop_at"]
    for req, _ in rows:
        if req.extra.get("student_timesteps") != timesteps or req.extra.get("stop_at") != stop_at:
            raise ValueError("one few-step call takes one set of student timesteps and one stop step")
        if (req.height, req.width) != (first.height, first.width):
            raise ValueError("one few-step call takes one image size")
    family, pipe = engine.family, engine.pipe
    conds = [_conditions(engine, req.prompt, req.negative_prompt, req.extra["negative"]) for req, _ in rows]
    model_cond = {
        k: v.to(engine.device, engine.dtype if v.is_floating_point() else v.dtype)
        for k, v in family.collate_conditions([c.positive for c in conds]).items()
    }
    shape = family.latent_shape(pipe, first.height, first.width, first.num_frames)
    generators = engine.noise_generators([req.seeds[b] for req, b in rows])  # --diffusion-generator-device
    noise = torch.stack([draw_normal(shape, g) for g in generators])

    def velocity(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        x_in, t_in = x.to(engine.device, engine.dtype), t.to(engine.device)
        return family.guided_velocity(engine.transformer, x_in, t_in, model_cond).cpu()

    def fresh_noise(_: torch.Size) -> torch.Tensor:
        return torch.stack([draw_normal(shape, g) for g in generators])

    if stop_at is None:
        x0 = few_step_sample(velocity, noise, timesteps, fresh_noise)
        images = family.decode_latents(pipe, x0.to(engine.device)).float().cpu()
        trajectories: list[Trajectory | None] = [None] * len(rows)
    else:
        sim = backward_simulate(velocity, noise, timesteps, int(stop_at), fresh_noise)
        x0 = x0_at(velocity, sim.x_t, sim.timestep)
        latents = torch.stack([*sim.states, x0], dim=1)
        ts = torch.tensor(timesteps[: sim.step + 1], dtype=torch.float32)
        sigmas = torch.cat([ts / 1000.0, torch.zeros(1)])
        images = None
        trajectories = [
            Trajectory(
                latents=latents[i].clone(), timesteps=ts.clone(), sigmas=sigmas.clone(), sde_type=FEW_STEP_SDE_TYPE
            )
            for i in range(len(rows))
        ]
    elapsed = (time.perf_counter() - start) / len(rows)
    samples = []
    for i, ((req, b), cond) in enumerate(zip(rows, conds, strict=True)):
        samples.append(
            req.sample(
                b,
                trajectory=trajectories[i],
                conditions=None if stop_at is None else cond,
                image=None if images is None else images[i].clone(),  # not a view of the whole batch
                inference_time_s=elapsed,
            )
        )
    return samples
