"""The sglang `/rollout/generate` protocol, no server: request splitting, payloads, and the msgpack wire
format back to `Sample`s (responses built byte for byte the way sglang-diffusion encodes them).
"""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
import torch
from safetensors.torch import save as safetensors_save

from miles.core.sample import COMPLETED
from miles.rollout.engines.base import GenerateRequest
from miles.rollout.engines.sglang.protocol import (
    decode_body,
    parse_response,
    rollout_payload,
    server_requests,
)

# ---------------------------------------------------------------------------- helpers

T, C, LH, LW = 10, 4, 8, 8  # denoising steps, latent channels / height / width
H, W = 64, 64  # image size
L, D, P = 7, 16, 12  # text tokens, hidden size, pooled size
SDE_STEPS = [5, 0, 2]  # deliberately unsorted


def make_request(
    seeds: list[int] | None = None,
    sde_steps: list[list[int]] | None = None,
    indices: list[int] | None = None,
    **changes: Any,
) -> GenerateRequest:
    seeds = [100, 101] if seeds is None else seeds
    fields: dict[str, Any] = {
        "prompt": "a handwritten 7",
        "metadata": {"label": 7, "tags": ["digit"]},
        "group_index": 3,
        "indices": list(range(4, 4 + len(seeds))) if indices is None else indices,
        "seeds": seeds,
        "sde_steps": [list(SDE_STEPS) for _ in seeds] if sde_steps is None else sde_steps,
        "num_steps": T,
        "guidance_scale": 4.5,
        "noise_level": 0.7,
        "sde_type": "sde",
        "height": H,
        "width": W,
    }
    fields.update(changes)
    return GenerateRequest(**fields)


def encode_tensor(t: torch.Tensor) -> dict[str, Any]:
    """One tensor as sglang-diffusion puts it on the wire."""
    return {
        "__tensor__": True,
        "data": safetensors_save({"t": t.contiguous()}),
        "shape": list(t.shape),
        "dtype": str(t.dtype).removeprefix("torch."),
    }


def cond_kwargs(gen: torch.Generator, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {
        "encoder_hidden_states": torch.randn(1, L, D, generator=gen).to(dtype),
        "pooled_projections": torch.randn(1, P, generator=gen).to(dtype),
    }


def training_output(b: int) -> dict[str, Any]:
    """The plain (undecoded) tensors of one training output; every output gets different values."""
    gen = torch.Generator().manual_seed(1000 + b)
    sigmas = torch.linspace(1.0, 0.0, T + 1)
    return {
        "generated_output": torch.rand(3, H, W, generator=gen),
        "rollout_log_probs": torch.randn(T, generator=gen) - 3.0,
        "dit_trajectory": {
            "latents": torch.randn(T + 1, C, LH, LW, generator=gen),
            "timesteps": sigmas * 1000.0,
            "sigmas": sigmas,
        },
        "denoising_env": {
            "pos_cond_kwargs": cond_kwargs(gen, torch.bfloat16),
            "neg_cond_kwargs": cond_kwargs(gen, torch.bfloat16),
        },
        "inference_time_s": 3.0 + b,
    }


def encode_tree(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return encode_tensor(obj)
    if isinstance(obj, dict):
        return {k: encode_tree(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [encode_tree(v) for v in obj]
    return obj


def wire_body(outputs: list[dict[str, Any]]) -> bytes:
    return msgpack.packb(encode_tree(outputs), use_bin_type=True)


# ---------------------------------------------------------------------------- server_requests


def test_consecutive_seeds_with_the_same_steps_are_one_server_request() -> None:
    req = make_request(seeds=[10, 11, 12, 13])
    assert server_requests(req) == [req]
    assert server_requests(req)[0] is req


def test_a_single_seed_is_one_server_request() -> None:
    req = make_request(seeds=[7], indices=[0])
    assert server_requests(req)[0] is req


def test_a_gap_in_the_seeds_splits_the_request() -> None:
    req = make_request(seeds=[10, 11, 20, 21, 22], indices=[0, 1, 2, 3, 4])
    runs = server_requests(req)
    assert [r.seeds for r in runs] == [[10, 11], [20, 21, 22]]
    assert [r.indices for r in runs] == [[0, 1], [2, 3, 4]]
    assert [r.sde_steps for r in runs] == [[SDE_STEPS] * 2, [SDE_STEPS] * 3]
    for run in runs:  # everything else is the request's
        assert (run.prompt, run.group_index, run.num_steps, run.guidance_scale) == ("a handwritten 7", 3, T, 4.5)
        assert run.metadata == req.metadata


def test_descending_seeds_are_not_consecutive() -> None:
    runs = server_requests(make_request(seeds=[5, 4], indices=[8, 9]))
    assert [(r.seeds, r.indices) for r in runs] == [([5], [8]), ([4], [9])]


def test_different_sde_steps_split_the_request() -> None:
    steps = [[0, 1], [0, 1], [3], [0, 1]]
    req = make_request(seeds=[50, 51, 52, 53], indices=[12, 13, 14, 15], sde_steps=steps)
    runs = server_requests(req)
    assert [r.seeds for r in runs] == [[50, 51], [52], [53]]
    assert [r.indices for r in runs] == [[12, 13], [14], [15]]
    assert [r.sde_steps for r in runs] == [[[0, 1], [0, 1]], [[3]], [[0, 1]]]
    # every run is a valid server request again: consecutive seeds, one step list
    for run in runs:
        assert server_requests(run)[0] is run


# ---------------------------------------------------------------------------- rollout_payload


def test_training_payload() -> None:
    req = make_request(seeds=[100, 101, 102], negative_prompt=None)
    payload = rollout_payload(req)
    assert payload == {
        "prompt": "a handwritten 7",
        "negative_prompt": " ",
        "seed": 100,
        "generator_device": "cpu",
        "width": W,
        "height": H,
        "num_inference_steps": T,
        "num_outputs_per_prompt": 3,
        "guidance_scale": 4.5,
        "rollout": True,
        "suppress_logs": True,
        "rollout_sde_type": "sde",
        "rollout_noise_level": 0.7,
        "rollout_debug_mode": False,
        "rollout_return_denoising_env": True,
        "rollout_return_dit_trajectory": True,
        "rollout_sde_step_indices": [0, 2, 5],
    }
    assert isinstance(payload["guidance_scale"], float)


def test_training_payload_keeps_a_given_negative_prompt_and_device() -> None:
    payload = rollout_payload(make_request(negative_prompt="blurry", sde_type="cps"), generator_device="cuda")
    assert payload["negative_prompt"] == "blurry"
    assert payload["generator_device"] == "cuda"
    assert payload["rollout_sde_type"] == "cps"


def test_evaluation_payload_has_no_rollout_options() -> None:
    req = make_request(seeds=[8, 9], sde_steps=[[], []], evaluation=True, sde_type="ode", noise_level=0.0)
    payload = rollout_payload(req)
    assert payload["rollout"] is False
    assert payload["seed"] == 8
    assert payload["num_outputs_per_prompt"] == 2
    assert [key for key in payload if key.startswith("rollout_")] == []


@pytest.mark.parametrize(
    ("sde_type", "noise_level", "steps"),
    [("ode", 0.0, []), ("ode", 0.7, [1, 2]), ("sde", 0.0, [1, 2]), ("sde", 0.7, [])],
    ids=["ode", "ode-with-noise", "zero-noise", "no-sde-steps"],
)
def test_deterministic_payload_is_an_ode_rollout(sde_type: str, noise_level: float, steps: list[int]) -> None:
    req = make_request(seeds=[3, 4], sde_steps=[list(steps), list(steps)], sde_type=sde_type, noise_level=noise_level)
    payload = rollout_payload(req)
    assert payload["rollout"] is True
    assert payload["rollout_sde_type"] == "ode"
    assert payload["rollout_noise_level"] == 0.0
    assert "rollout_sde_step_indices" not in payload
    assert payload["rollout_return_dit_trajectory"] is True
    assert payload["rollout_return_denoising_env"] is True


# ---------------------------------------------------------------------------- wire format


@pytest.mark.parametrize("guidance_scale", [4.5, 1.0])
def test_training_response_becomes_samples(guidance_scale: float) -> None:
    req = make_request(seeds=[100, 101], indices=[6, 7], guidance_scale=guidance_scale)
    sent = [training_output(0), training_output(1)]
    samples = parse_response(req, wire_body(sent))

    assert [(s.index, s.seed, s.group_index) for s in samples] == [(6, 100, 3), (7, 101, 3)]
    for b, (sample, out) in enumerate(zip(samples, sent, strict=True)):
        assert sample.status == COMPLETED
        assert sample.prompt == req.prompt
        assert sample.metadata == req.metadata
        assert sample.metadata is not req.metadata
        assert sample.inference_time_s == pytest.approx((3.0 + b) / 2)
        assert torch.equal(sample.image, out["generated_output"])

        traj = sample.trajectory
        dit = out["dit_trajectory"]
        assert traj.latents.shape == (T + 1, C, LH, LW)
        assert torch.equal(traj.latents, dit["latents"])
        assert torch.equal(traj.timesteps, dit["timesteps"][:T])
        assert traj.num_steps == T
        assert torch.equal(traj.sigmas, dit["sigmas"])
        assert traj.sigmas.shape == (T + 1,)
        assert traj.sde_step_indices == [0, 2, 5]
        assert torch.equal(traj.log_probs, out["rollout_log_probs"][[0, 2, 5]])
        assert (traj.sde_type, traj.noise_level) == ("sde", 0.7)

        cond = sample.conditions
        assert cond.guidance_scale == guidance_scale
        pos = out["denoising_env"]["pos_cond_kwargs"]
        assert set(cond.positive) == {"encoder_hidden_states", "pooled_projections"}
        assert cond.positive["encoder_hidden_states"].shape == (L, D)
        assert cond.positive["pooled_projections"].shape == (P,)
        for key, value in cond.positive.items():
            assert value.dtype == torch.float32
            assert torch.equal(value, pos[key][0].float())
        if guidance_scale > 1.0:
            neg = out["denoising_env"]["neg_cond_kwargs"]
            assert set(cond.negative) == set(neg)
            for key, value in cond.negative.items():
                assert torch.equal(value, neg[key][0].float())
            assert not torch.equal(cond.negative["encoder_hidden_states"], cond.positive["encoder_hidden_states"])
        else:
            assert cond.negative is None
    # per-output values are not mixed up between outputs
    assert not torch.equal(samples[0].trajectory.latents, samples[1].trajectory.latents)


def test_the_samples_round_trip_through_to_dict() -> None:
    from miles.core.sample import Sample

    req = make_request(seeds=[1], indices=[0])
    (sample,) = parse_response(req, wire_body([training_output(0)]))
    again = Sample.from_dict(sample.to_dict())
    assert torch.equal(again.trajectory.log_probs, sample.trajectory.log_probs)
    assert again.trajectory.sde_step_indices == [0, 2, 5]
    assert torch.equal(
        again.conditions.positive["pooled_projections"], sample.conditions.positive["pooled_projections"]
    )


def test_ode_response_records_no_sde_steps() -> None:
    req = make_request(seeds=[1, 2], sde_steps=[[], []], sde_type="ode", noise_level=0.0)
    samples = parse_response(req, wire_body([training_output(0), training_output(1)]))
    for sample in samples:
        assert sample.trajectory.sde_step_indices == []
        assert sample.trajectory.log_probs.numel() == 0
        assert sample.trajectory.latents.shape == (T + 1, C, LH, LW)


def test_evaluation_response_has_no_trajectory() -> None:
    req = make_request(seeds=[40, 41], indices=[0, 1], sde_steps=[[], []], evaluation=True, sde_type="ode")
    images = [torch.rand(3, H, W, generator=torch.Generator().manual_seed(b)) for b in range(2)]
    body = wire_body([{"generated_output": img, "inference_time_s": 2.0} for img in images])
    samples = parse_response(req, body)
    assert [(s.index, s.seed) for s in samples] == [(0, 40), (1, 41)]
    for sample, image in zip(samples, images, strict=True):
        assert sample.trajectory is None
        assert sample.conditions is None
        assert torch.equal(sample.image, image)
        assert sample.inference_time_s == pytest.approx(1.0)


def test_a_bf16_image_is_returned_as_float32() -> None:
    req = make_request(seeds=[1], indices=[0], sde_steps=[[]], evaluation=True, sde_type="ode")
    image = torch.tensor([0.0, 0.25, 0.5, 1.0]).repeat(3, 1, 1).to(torch.bfloat16)
    (sample,) = parse_response(req, wire_body([{"generated_output": image}]))
    assert sample.image.dtype == torch.float32
    assert sample.image[0, 0].tolist() == [0.0, 0.25, 0.5, 1.0]
    assert sample.inference_time_s == 0.0


def test_an_output_count_mismatch_names_the_prompt() -> None:
    req = make_request(seeds=[1, 2, 3])
    with pytest.raises(ValueError, match=r"2 outputs for 3 seeds.*'a handwritten 7'"):
        parse_response(req, wire_body([training_output(0), training_output(1)]))


def test_a_body_that_is_not_a_list_is_rejected() -> None:
    with pytest.raises(ValueError, match="is a dict"):
        decode_body(msgpack.packb({"error": "boom"}))


def test_a_training_response_without_conditions_is_rejected() -> None:
    out = training_output(0)
    del out["denoising_env"]
    with pytest.raises(ValueError, match="denoising_env"):
        parse_response(make_request(seeds=[1], indices=[0]), wire_body([out]))


def test_an_sde_response_without_log_probs_is_rejected() -> None:
    out = training_output(0)
    del out["rollout_log_probs"]
    with pytest.raises(ValueError, match="no rollout_log_probs for SDE steps"):
        parse_response(make_request(seeds=[1], indices=[0]), wire_body([out]))


def test_debug_mode_asks_for_and_keeps_the_per_step_model_outputs() -> None:
    """--diffusion-debug-mode: the request sets rollout_debug_mode, each sample keeps the engine's model output
    of every step (`Trajectory.debug_model_outputs`, what train/model_output_*_abs_diff compare), and a
    response without them is an error naming the flag instead of a silent drop."""
    req = make_request(debug=True)
    assert rollout_payload(req)["rollout_debug_mode"] is True
    sent = [training_output(0), training_output(1)]
    for b, out in enumerate(sent):
        out["rollout_debug_tensors"] = {"rollout_model_outputs": torch.randn(T, C, LH, LW) + b}
    samples = parse_response(req, wire_body(sent))
    for sample, out in zip(samples, sent, strict=True):
        assert torch.equal(
            sample.trajectory.debug_model_outputs, out["rollout_debug_tensors"]["rollout_model_outputs"]
        )
    assert (
        parse_response(make_request(), wire_body([training_output(0), training_output(1)]))[
            0
        ].trajectory.debug_model_outputs
        is None
    )
    with pytest.raises(ValueError, match="--diffusion-debug-mode"):
        parse_response(req, wire_body([training_output(0), training_output(1)]))
    short = [training_output(0), training_output(1)]
    for out in short:
        out["rollout_debug_tensors"] = {"rollout_model_outputs": torch.randn(T - 1, C, LH, LW)}
    with pytest.raises(ValueError, match="model outputs for 9 steps"):
        parse_response(req, wire_body(short))
