"""The `POST /rollout/generate` protocol of sglang-diffusion: requests out, samples back.

One miles microgroup (`GenerateRequest`) becomes one server request when its seeds are consecutive and
every sample runs the same SDE steps (the server expands `seed` to `seed .. seed+M-1` and takes one step
list per request); otherwise it is split into runs that are (`server_requests`).

The response is msgpack: a list with one entry per output, every tensor encoded as
`{"__tensor__": true, "data": <safetensors bytes of {"t": tensor}>, ...}`. `samples_from_outputs`
turns it into the same `Sample`/`Trajectory`/`Conditions` the diffusers engine returns:

    dit_trajectory.latents   [T+1, ...]  x_0 .. x_T             -> Trajectory.latents (`from_engine_latents`)
    dit_trajectory.timesteps [T+1] (ends in 0)                  -> Trajectory.timesteps[:T]
    dit_trajectory.sigmas    [T+1] (ends in 0)                  -> Trajectory.sigmas
    rollout_log_probs        [T], per-step mean over elements   -> Trajectory.log_probs at the SDE steps
    denoising_env.pos/neg_cond_kwargs (+ guidance)              -> Conditions.positive / negative
                                                                   (`from_engine_conditions`)
    generated_output         [3, H, W] in [0, 1]                -> Sample.image (`from_engine_image`)
                             (a video family's [3, F, H, W])

A video family's requests carry `num_frames` and `fps`; a family with experts (Wan2.2) sends the low-noise
expert's CFG scale as `extra_sampling_params.guidance_scale_2` and gets it back in `Conditions`.

What differs per model family goes through its `TrainPipelineConfig` (`family`; None: the base adapter,
which is SD3's): the guidance fields of the request (`sglang_request_fields`), the latent layout sglang
returns (flux and qwen_image send 2x2-packed tokens) and the condition tensors it keeps.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from miles.rollout.engines.base import GenerateRequest

if TYPE_CHECKING:
    from miles.core.sample import Sample
    from miles.models.pipeline_config import TrainPipelineConfig

GENERATE_PATH = "/rollout/generate"


def server_requests(req: GenerateRequest) -> list[GenerateRequest]:
    """`req` split into runs of consecutive seeds with identical SDE steps (usually just `[req]`)."""
    runs: list[list[int]] = []
    for b in range(len(req.seeds)):
        if runs:
            last = runs[-1][-1]
            if req.seeds[b] == req.seeds[last] + 1 and req.sde_steps[b] == req.sde_steps[last]:
                runs[-1].append(b)
                continue
        runs.append([b])
    if len(runs) == 1:
        return [req]
    return [
        replace(
            req,
            indices=[req.indices[b] for b in run],
            seeds=[req.seeds[b] for b in run],
            sde_steps=[req.sde_steps[b] for b in run],
        )
        for run in runs
    ]


def engine_family(args: Any) -> TrainPipelineConfig:
    """The model family of a job's checkpoint (`--diffusion-model-family`, else from the checkpoint name)."""
    from miles.models.families import args_family

    return args_family(args)


def _adapter(family: TrainPipelineConfig | None) -> TrainPipelineConfig:
    from miles.models.pipeline_config import TrainPipelineConfig

    return family if family is not None else TrainPipelineConfig()


def rollout_payload(
    req: GenerateRequest,
    generator_device: str = "cpu",
    family: TrainPipelineConfig | None = None,
    max_sequence_length: int | None = None,
) -> dict[str, Any]:
    """The JSON body of one `POST /rollout/generate` (`req` must already be one server request);
    `max_sequence_length` is the checkpoint's text length, for families that send it."""
    adapter = _adapter(family)
    payload: dict[str, Any] = {
        "prompt": req.prompt,
        "negative_prompt": req.negative_prompt if req.negative_prompt is not None else " ",
        "seed": int(req.seeds[0]),  # the server requires a seed; output i uses seed + i
        "generator_device": generator_device,
        "width": int(req.width),
        "height": int(req.height),
        "num_inference_steps": int(req.num_steps),
        "num_outputs_per_prompt": len(req.seeds),
        **adapter.sglang_request_fields(req.guidance_scale, req.true_cfg_scale),
        "rollout": not req.evaluation,
        "suppress_logs": True,
    }
    payload.update(video_fields(req, adapter))
    extra = adapter.sglang_sampling_params(max_sequence_length) if max_sequence_length is not None else {}
    extra = {**extra, **expert_sampling_params(req, adapter)}
    if extra:
        payload["extra_sampling_params"] = extra
    if req.evaluation:
        return payload
    steps = req.sde_steps[0]
    stochastic = req.sde_type != "ode" and req.noise_level > 0 and bool(steps)
    payload.update(
        rollout_sde_type=req.sde_type if stochastic else "ode",
        rollout_noise_level=float(req.noise_level) if stochastic else 0.0,
        rollout_debug_mode=bool(req.debug),
        rollout_return_denoising_env=True,
        rollout_return_dit_trajectory=True,
    )
    if stochastic:
        payload["rollout_sde_step_indices"] = sorted(int(s) for s in steps)
    return payload


def video_fields(req: GenerateRequest, adapter: TrainPipelineConfig) -> dict[str, int]:
    """A video family's `num_frames` and `fps` (sglang's request fields; image pipelines ignore them). sglang
    takes an integer frame rate: a fractional `--diffusion-fps` is left out (a text-to-video DiT does not see
    it; it only names the rate of the files miles writes)."""
    if not adapter.makes_video:
        return {}
    fields = {"num_frames": int(req.num_frames)}
    if req.fps is not None and float(req.fps).is_integer():
        fields["fps"] = int(req.fps)
    return fields


def expert_sampling_params(req: GenerateRequest, adapter: TrainPipelineConfig) -> dict[str, float]:
    """A family with experts (Wan2.2) gets the low-noise expert's CFG scale as `guidance_scale_2` in
    `extra_sampling_params`: sglang's Wan2.2 defaults it to 3.0, miles (as `guided_velocity`) to the
    guidance scale."""
    if not adapter.experts:
        return {}
    scale_2 = req.guidance_scale_2 if req.guidance_scale_2 is not None else req.guidance_scale
    return {"guidance_scale_2": float(scale_2)}


def decode_tensors(obj: Any) -> Any:
    """Replace every encoded tensor in a decoded msgpack tree by the tensor."""
    if isinstance(obj, dict):
        if obj.get("__tensor__"):
            from safetensors.torch import load

            return load(bytes(obj["data"]))["t"]
        return {k: decode_tensors(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode_tensors(v) for v in obj]
    return obj


def decode_body(body: bytes) -> list[dict[str, Any]]:
    """A `/rollout/generate` response body: one dict per output, tensors decoded."""
    import msgpack

    outputs = decode_tensors(msgpack.unpackb(body, raw=False))
    if not isinstance(outputs, list):
        raise ValueError(f"rollout response is a {type(outputs).__name__}, expected a list of outputs")
    return outputs


def samples_from_outputs(
    req: GenerateRequest, outputs: list[dict[str, Any]], family: TrainPipelineConfig | None = None
) -> list[Sample]:
    """The completed samples of one server request, in seed order."""
    from miles.core.sample import Conditions, Trajectory

    adapter = _adapter(family)
    cfg_scale = adapter.cfg_scale(req.guidance_scale, req.true_cfg_scale)
    scale_2 = req.guidance_scale_2 if cfg_scale > 1.0 and adapter.experts else None  # as the diffusers engine
    m = len(req.seeds)
    if len(outputs) != m:
        raise ValueError(f"engine returned {len(outputs)} outputs for {m} seeds (prompt {req.prompt!r})")
    samples: list[Sample] = []
    for b, out in enumerate(outputs):
        image = adapter.from_engine_image(out["generated_output"])
        elapsed = float(out.get("inference_time_s") or 0.0) / m
        if req.evaluation:
            samples.append(
                req.sample(
                    b,
                    trajectory=None,
                    conditions=None,
                    image=image,
                    inference_time_s=elapsed,
                    denoiser_calls=float(req.num_steps),  # every output its own trajectory
                )
            )
            continue
        dit = out["dit_trajectory"]
        latents = adapter.from_engine_latents(dit["latents"], req.height, req.width)
        num_steps = latents.shape[0] - 1
        steps = sorted(req.sde_steps[b]) if req.sde_type != "ode" and req.noise_level > 0 else []
        all_log_probs = out.get("rollout_log_probs")
        if steps and all_log_probs is None:
            raise ValueError(f"engine returned no rollout_log_probs for SDE steps {steps} (prompt {req.prompt!r})")
        log_probs = all_log_probs.float()[steps].clone() if steps else None
        trajectory = Trajectory(
            latents=latents,
            timesteps=dit["timesteps"].float()[:num_steps].clone(),
            sigmas=dit["sigmas"].float().clone(),
            sde_step_indices=steps,
            log_probs=log_probs if log_probs is not None else _empty(),
            sde_type=req.sde_type,
            noise_level=req.noise_level,
            debug_model_outputs=_debug_outputs(adapter, req, out, num_steps) if req.debug else None,
        )
        env = out.get("denoising_env") or {}
        positive = _cond_rows(adapter, env, "pos_cond_kwargs")
        negative = _cond_rows(adapter, env, "neg_cond_kwargs") if cfg_scale > 1.0 else None
        samples.append(
            req.sample(
                b,
                trajectory=trajectory,
                conditions=Conditions(positive, negative, cfg_scale if cfg_scale > 1.0 else 1.0, scale_2),
                image=image,
                inference_time_s=elapsed,
                denoiser_calls=float(num_steps),
            )
        )
    return samples


def _debug_outputs(adapter: TrainPipelineConfig, req: GenerateRequest, out: dict[str, Any], num_steps: int) -> Any:
    """--diffusion-debug-mode: sglang's per-step model outputs (`rollout_debug_tensors.rollout_model_outputs`)
    in the family's natural layout, `[T, *latent]`; a response without them is an error naming the flag."""
    debug = out.get("rollout_debug_tensors") or {}
    outputs = debug.get("rollout_model_outputs") if isinstance(debug, dict) else None
    if outputs is None:
        raise ValueError(
            "--diffusion-debug-mode: the engine returned no rollout_debug_tensors.rollout_model_outputs "
            f"(prompt {req.prompt!r})"
        )
    outputs = adapter.from_engine_latents(outputs.float(), req.height, req.width)
    if outputs.shape[0] != num_steps:
        raise ValueError(
            f"--diffusion-debug-mode: the engine returned model outputs for {outputs.shape[0]} steps, the "
            f"trajectory has {num_steps}"
        )
    return outputs.clone()


def parse_response(req: GenerateRequest, body: bytes, family: TrainPipelineConfig | None = None) -> list[Sample]:
    return samples_from_outputs(req, decode_body(body), family)


def _cond_rows(adapter: TrainPipelineConfig, env: dict[str, Any], key: str) -> dict[str, Any]:
    """The family's condition rows of one output from `env[key]` (float32, no batch dim)."""
    kwargs = env.get(key)
    if not kwargs:
        raise ValueError(f"engine response has no denoising_env {key} (rollout_return_denoising_env)")
    return adapter.from_engine_conditions(kwargs, env)


def _empty() -> Any:
    import torch

    return torch.zeros(0)
