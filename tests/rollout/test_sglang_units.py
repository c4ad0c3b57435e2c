"""Unit tests of the sglang rollout backend that need no sglang server and no Ray.

Covered: the `/rollout/generate` protocol (request splitting, payloads, the msgpack wire format back to
`Sample`s), weight sync files and digests, the server command line, the backend config rules and
`find_engine_failure`. Responses are built byte for byte the way sglang-diffusion encodes them.
"""

from __future__ import annotations

import hashlib
import socket
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from safetensors.torch import save as safetensors_save

from miles.config.errors import ConfigError, EngineFailure, find_engine_failure
from miles.config.resolve import ResolvedJob, resolve
from miles.rollout.engines.base import GenerateRequest
from miles.rollout.engines.sglang.protocol import (
    decode_body,
    parse_response,
    rollout_payload,
    server_requests,
)
from miles.rollout.engines.sglang.server import (
    PYTHON_ENV_VAR,
    ServerSpec,
    free_port,
    gpus_present,
    resolve_sglang_python,
)
from miles.rollout.engines.sglang.sync import (
    KEEP_VERSIONS,
    WEIGHTS_FILE,
    expected_sha256,
    lora_wrapped_names,
    tensor_sha256,
    transformer_layout,
    write_lora_adapter,
    write_transformer,
)
from miles.rollout.types import COMPLETED

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


def flag_values(argv: list[str], flag: str) -> list[str]:
    """The values after `flag` (up to the next `--` option); asserts the flag occurs exactly once."""
    assert argv.count(flag) == 1, f"{flag} occurs {argv.count(flag)} times in {argv}"
    start = argv.index(flag) + 1
    end = start
    while end < len(argv) and not argv[end].startswith("--"):
        end += 1
    return argv[start:end]


def job(job_name: str, recipe: str, **cli: Any) -> ResolvedJob:
    return resolve(job_name, recipe=recipe, cli=cli)


def config_error(job_name: str, recipe: str, **cli: Any) -> str:
    with pytest.raises(ConfigError) as excinfo:
        job(job_name, recipe, **cli)
    return str(excinfo.value)


@pytest.fixture
def fake_python(tmp_path: Path) -> Path:
    """An existing file to hand to --sglang-python (only its existence is checked)."""
    path = tmp_path / "env" / "bin" / "python"
    path.parent.mkdir(parents=True)
    path.write_text("#!/bin/sh\n")
    return path


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
    from miles.rollout.types import Sample

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


# ---------------------------------------------------------------------------- sync: digests


def reference_sha256(t: torch.Tensor) -> str:
    hasher = hashlib.sha256()
    hasher.update(str(t.dtype).encode())
    hasher.update(repr(tuple(t.shape)).encode())
    hasher.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_tensor_sha256_is_dtype_shape_and_bytes(dtype: torch.dtype) -> None:
    t = torch.randn(3, 5, generator=torch.Generator().manual_seed(0)).to(dtype)
    digest = tensor_sha256(t)
    assert digest == reference_sha256(t)
    assert len(digest) == 64
    # a transposed (non-contiguous) view hashes its values in logical order
    assert tensor_sha256(t.t()) == reference_sha256(t.t().contiguous())


def test_tensor_sha256_sees_one_ulp_dtype_and_shape() -> None:
    t = torch.tensor([1.0, 2.0, 3.0, 4.0])
    bumped = t.clone()
    bumped[2] = torch.nextafter(bumped[2], torch.tensor(10.0))
    assert bumped[2].item() != 3.0
    digests = {
        tensor_sha256(t),
        tensor_sha256(bumped),
        tensor_sha256(t.view(torch.int32)),  # same bytes, other dtype
        tensor_sha256(t.view(2, 2)),  # same bytes, other shape
    }
    assert len(digests) == 4


def test_expected_sha256_casts_to_the_engine_dtype() -> None:
    state = {"a.weight": torch.randn(4, 4), "a.bias": torch.randn(4)}
    expected = expected_sha256(state, torch.bfloat16)
    assert expected == {name: reference_sha256(t.to(torch.bfloat16)) for name, t in state.items()}
    assert expected["a.weight"] != tensor_sha256(state["a.weight"])


def test_lora_wrapped_names() -> None:
    names = [
        "blocks.0.attn.to_q.weight",
        "blocks.0.attn.to_q.bias",
        "blocks.0.ff.net.2.weight",  # a linear without bias
        "pos_embed.proj.weight",  # conv
        "pos_embed.proj.bias",
        "blocks.0.norm.weight",  # norm
        "blocks.0.norm.bias",
        "norm_out.linear.weight",
        "norm_out.linear.bias",
        "blocks.0.attn.to_q_extra.weight",  # a name that only starts like a linear's
    ]
    linears = frozenset({"blocks.0.attn.to_q", "blocks.0.ff.net.2", "norm_out.linear"})
    assert lora_wrapped_names(names, linears) == {
        "blocks.0.attn.to_q.weight": "blocks.0.attn.to_q.base_layer.weight",
        "blocks.0.attn.to_q.bias": "blocks.0.attn.to_q.base_layer.bias",
        "blocks.0.ff.net.2.weight": "blocks.0.ff.net.2.base_layer.weight",
        "pos_embed.proj.weight": "pos_embed.proj.weight",
        "pos_embed.proj.bias": "pos_embed.proj.bias",
        "blocks.0.norm.weight": "blocks.0.norm.weight",
        "blocks.0.norm.bias": "blocks.0.norm.bias",
        "norm_out.linear.weight": "norm_out.linear.base_layer.weight",
        "norm_out.linear.bias": "norm_out.linear.base_layer.bias",
        "blocks.0.attn.to_q_extra.weight": "blocks.0.attn.to_q_extra.weight",
    }


# ---------------------------------------------------------------------------- sync: files


def test_write_transformer_layout_dtype_and_values(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    state = {"a.weight": torch.randn(4, 3, generator=gen), "a.bias": torch.randn(4, generator=gen)}
    path = write_transformer(state, tmp_path, 1, torch.bfloat16)
    assert path == tmp_path / "v1"
    weights = path / "transformer" / WEIGHTS_FILE
    assert weights.is_file()
    loaded = load_file(str(weights))
    assert set(loaded) == set(state)
    for name, t in state.items():
        assert loaded[name].dtype == torch.bfloat16
        assert torch.equal(loaded[name], t.to(torch.bfloat16))
    # what the engine will hash is what expected_sha256 predicts
    assert {n: tensor_sha256(t) for n, t in loaded.items()} == expected_sha256(state, torch.bfloat16)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v1"]


def test_write_transformer_keeps_the_newest_versions(tmp_path: Path) -> None:
    assert KEEP_VERSIONS == 2
    (tmp_path / "lora_v1.safetensors").write_bytes(b"x")  # another kind of file: left alone
    (tmp_path / "vnotes").mkdir()  # not a version
    for version in (1, 2, 3, 4):
        state = {"w": torch.full((2, 2), float(version))}
        write_transformer(state, tmp_path, version, torch.float32)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["lora_v1.safetensors", "v3", "v4", "vnotes"]
    assert load_file(str(tmp_path / "v4" / "transformer" / WEIGHTS_FILE))["w"].tolist() == [[4.0, 4.0]] * 2
    assert load_file(str(tmp_path / "v3" / "transformer" / WEIGHTS_FILE))["w"].tolist() == [[3.0, 3.0]] * 2


def test_write_transformer_replaces_a_version_and_a_stale_tmp(tmp_path: Path) -> None:
    stale = tmp_path / ".v2.tmp" / "transformer"
    stale.mkdir(parents=True)
    (stale / "junk").write_text("left by a crash")
    write_transformer({"w": torch.zeros(2)}, tmp_path, 2, torch.float32)
    write_transformer({"w": torch.ones(2)}, tmp_path, 2, torch.float32)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v2"]
    assert sorted(p.name for p in (tmp_path / "v2" / "transformer").iterdir()) == [WEIGHTS_FILE]
    assert load_file(str(tmp_path / "v2" / "transformer" / WEIGHTS_FILE))["w"].tolist() == [1.0, 1.0]


def lora_payload(scalings: dict[str, float], rank: int = 4, dims: tuple[int, int] = (6, 5)) -> dict[str, torch.Tensor]:
    """A `miles.models.lora_sync` payload: `<module>.lora_A` [r, in], `.lora_B` [out, r], `.lora_scaling` 0-d."""
    gen = torch.Generator().manual_seed(rank)
    out, inp = dims
    payload: dict[str, torch.Tensor] = {}
    for module, scaling in scalings.items():
        payload[f"{module}.lora_A"] = torch.randn(rank, inp, generator=gen)
        payload[f"{module}.lora_B"] = torch.randn(out, rank, generator=gen)
        payload[f"{module}.lora_scaling"] = torch.tensor(scaling, dtype=torch.float64)
    return payload


MODULES = ("transformer_blocks.0.attn.to_q", "transformer_blocks.1.ff.net.2")


def test_lora_adapter_with_one_integer_alpha(tmp_path: Path) -> None:
    payload = lora_payload(dict.fromkeys(MODULES, 2.0), rank=4)  # peft: alpha 8 / rank 4
    path, alpha = write_lora_adapter(payload, tmp_path / "lora", 1)
    assert path == tmp_path / "lora" / "lora_v1.safetensors"
    assert alpha == 8
    assert isinstance(alpha, int)
    tensors = load_file(str(path))
    assert set(tensors) == {f"{m}.lora_{ab}.weight" for m in MODULES for ab in "AB"}
    for m in MODULES:
        assert torch.equal(tensors[f"{m}.lora_A.weight"], payload[f"{m}.lora_A"])
        assert torch.equal(tensors[f"{m}.lora_B.weight"], payload[f"{m}.lora_B"])  # not folded
        assert tensors[f"{m}.lora_B.weight"].shape == (6, 4)
    assert sorted(p.name for p in (tmp_path / "lora").iterdir()) == ["lora_v1.safetensors"]


@pytest.mark.parametrize(
    "scalings",
    [{MODULES[0]: 0.3, MODULES[1]: 0.3}, {MODULES[0]: 2.0, MODULES[1]: 0.5}],
    ids=["non-integer-alpha", "mixed-scalings"],
)
def test_lora_adapter_folds_other_scalings_into_b(tmp_path: Path, scalings: dict[str, float]) -> None:
    payload = lora_payload(scalings, rank=4)
    path, alpha = write_lora_adapter(payload, tmp_path, 5)
    assert alpha == 4  # alpha == rank: sglang applies no further scale
    tensors = load_file(str(path))
    for m, scaling in scalings.items():
        assert torch.equal(tensors[f"{m}.lora_A.weight"], payload[f"{m}.lora_A"])
        b = tensors[f"{m}.lora_B.weight"]
        assert torch.allclose(b, payload[f"{m}.lora_B"] * scaling, rtol=0, atol=1e-7)
        assert not torch.allclose(b, payload[f"{m}.lora_B"])
        # the delta sglang applies (alpha / r) * B @ A equals peft's scaling * B @ A
        delta = (alpha / 4) * b @ tensors[f"{m}.lora_A.weight"]
        expected = scaling * payload[f"{m}.lora_B"] @ payload[f"{m}.lora_A"]
        assert torch.allclose(delta, expected, atol=1e-6)


def test_lora_adapter_keeps_the_newest_versions(tmp_path: Path) -> None:
    for version in (1, 2, 3):
        write_lora_adapter(lora_payload(dict.fromkeys(MODULES, 1.0)), tmp_path, version)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lora_v2.safetensors", "lora_v3.safetensors"]


def test_lora_adapter_without_lora_a_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no lora_A"):
        write_lora_adapter({"x.lora_B": torch.zeros(2, 2)}, tmp_path, 1)


@pytest.fixture
def tiny_sd3_checkpoint(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Path:
    """tiny-sd3 through `ensure_checkpoint`: the session's build, else the user's cached one (read-only),
    else the session fixture builds it (~40 s, once)."""
    from miles.models.checkpoints import builtin_checkpoint_dir, ensure_checkpoint, is_complete
    from miles.utils.paths import DEFAULT_MILES_HOME

    if not is_complete(builtin_checkpoint_dir("tiny-sd3"), "tiny-sd3"):
        cached_home = Path(DEFAULT_MILES_HOME).expanduser()
        if is_complete(cached_home / "models" / "tiny-sd3", "tiny-sd3"):
            monkeypatch.setenv("MILES_HOME", str(cached_home))
        else:
            return request.getfixturevalue("tiny_sd3_dir")
    return ensure_checkpoint("tiny-sd3", progress=False)


def test_transformer_layout_of_tiny_sd3(tiny_sd3_checkpoint: Path) -> None:
    params, linears = transformer_layout(tiny_sd3_checkpoint)
    assert isinstance(params, frozenset)
    assert isinstance(linears, frozenset)
    for name in (
        "transformer_blocks.0.attn.to_q.weight",
        "transformer_blocks.0.attn.to_q.bias",
        "transformer_blocks.0.ff.net.2.weight",
        "context_embedder.weight",
        "proj_out.weight",
        "pos_embed.proj.weight",
    ):
        assert name in params
    assert "pos_embed.pos_embed" not in params  # a buffer, not a parameter
    # exactly the saved tensors minus the buffers
    with safe_open(str(tiny_sd3_checkpoint / "transformer" / WEIGHTS_FILE), "pt") as f:
        saved_names = f.keys()
        shapes = {name: f.get_slice(name).get_shape() for name in saved_names}
    saved = set(shapes)
    assert params <= saved
    assert saved - params <= {"pos_embed.pos_embed"}

    # the linear modules: every one has a weight parameter; convs and norms are not among them
    assert {"transformer_blocks.0.attn.to_q", "transformer_blocks.0.ff.net.2", "proj_out"} <= linears
    assert "pos_embed.proj" not in linears
    assert all(f"{m}.weight" in params for m in linears)
    wrapped = lora_wrapped_names(params, linears)
    assert wrapped["transformer_blocks.0.attn.to_q.weight"] == "transformer_blocks.0.attn.to_q.base_layer.weight"
    assert wrapped["transformer_blocks.0.attn.to_q.bias"] == "transformer_blocks.0.attn.to_q.base_layer.bias"
    assert wrapped["pos_embed.proj.weight"] == "pos_embed.proj.weight"
    assert len(set(wrapped.values())) == len(params)
    # with this transformer the linears are exactly the owners of the 2-D weights
    two_d = {n[: -len(".weight")] for n, shape in shapes.items() if n.endswith(".weight") and len(shape) == 2}
    assert linears == two_d


# ---------------------------------------------------------------------------- server


def test_server_command_defaults(tmp_path: Path) -> None:
    python = tmp_path / "bin" / "python"
    spec = ServerSpec(
        python=str(python),
        model_path="/models/tiny-sd3",
        port=30000,
        model_id="stable-diffusion-3-medium-diffusers",
        precision="bf16",
        num_gpus=2,
        warmup=(128, 64),
    )
    argv = spec.command(scheduler_port=31000, master_port=32000)
    assert argv[:3] == [str(python), "-m", "sglang.cli.main"]  # no sglang script next to the python
    assert argv[3:6] == ["serve", "--model-path", "/models/tiny-sd3"]
    assert flag_values(argv, "--host") == ["127.0.0.1"]
    assert flag_values(argv, "--port") == ["30000"]
    assert flag_values(argv, "--scheduler-port") == ["31000"]
    assert flag_values(argv, "--master-port") == ["32000"]
    assert flag_values(argv, "--num-gpus") == ["2"]
    assert flag_values(argv, "--model-id") == ["stable-diffusion-3-medium-diffusers"]
    assert flag_values(argv, "--dit-precision") == ["bf16"]
    assert flag_values(argv, "--text-encoder-precisions") == ["bf16"] * 3
    assert flag_values(argv, "--vae-precision") == ["fp32"]
    assert flag_values(argv, "--vae-tiling") == ["false"]
    assert flag_values(argv, "--warmup-resolutions") == ["128x64"]
    assert spec.url == "http://127.0.0.1:30000"


def test_server_command_without_model_id_or_warmup(tmp_path: Path) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "python").write_text("")
    (bindir / "sglang").write_text("")
    spec = ServerSpec(python=str(bindir / "python"), model_path="/m", precision="fp8")
    argv = spec.command(scheduler_port=1, master_port=2)
    assert argv[:4] == [str(bindir / "sglang"), "serve", "--model-path", "/m"]  # the env's sglang script
    assert "--model-id" not in argv
    assert "--warmup-resolutions" not in argv
    assert flag_values(argv, "--dit-precision") == ["fp32"]  # an unknown precision falls back to fp32


def test_server_command_passthrough_overrides_the_defaults() -> None:
    spec = ServerSpec(
        python="/nowhere/python",
        model_path="/m",
        port=5,
        warmup=(64, 64),
        passthrough={
            "vae_tiling": True,
            "warmup_resolutions": ["64x64", "128x128"],
            "attention_backend": "fa3",
            "enable_torch_compile": False,
            "dit_precision": "fp16",
        },
    )
    argv = spec.command(scheduler_port=7, master_port=8)
    assert flag_values(argv, "--vae-tiling") == []  # True: the bare flag (store_true flags take no value)
    assert "--vae-tiling" in argv
    assert flag_values(argv, "--warmup-resolutions") == ["64x64", "128x128"]
    assert flag_values(argv, "--attention-backend") == ["fa3"]
    assert flag_values(argv, "--enable-torch-compile") == ["false"]
    assert flag_values(argv, "--dit-precision") == ["fp16"]


def test_resolve_sglang_python_with_an_explicit_path(tmp_path: Path, fake_python: Path) -> None:
    assert resolve_sglang_python(str(tmp_path / "missing" / "python")) is None
    assert resolve_sglang_python(str(tmp_path)) is None  # a directory is no interpreter
    assert resolve_sglang_python(str(fake_python)) == str(fake_python)


def test_resolve_sglang_python_reads_the_environment_variable(
    fake_python: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(PYTHON_ENV_VAR, str(fake_python))
    assert resolve_sglang_python(None) == str(fake_python)
    assert resolve_sglang_python("") == str(fake_python)


def test_no_gpus_when_cuda_visible_devices_is_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert gpus_present() is False


def test_free_port_pair() -> None:
    port = free_port(pair=True)
    assert 1024 <= port < 65535
    with socket.socket() as first, socket.socket() as second:
        first.bind(("127.0.0.1", port))
        second.bind(("127.0.0.1", port + 1))


def test_free_port_single() -> None:
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


# ---------------------------------------------------------------------------- config rules


def test_auto_backend_is_diffusers_without_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    args = job("rl", "tiny-digits-grpo", rollout_backend="auto").args
    assert (args.rollout_backend, args.source_of("rollout_backend")) == ("diffusers", "derived")
    assert args.use_miles_router is False


def test_auto_backend_on_this_machine() -> None:
    args = job("rl", "tiny-digits-grpo", rollout_backend="auto").args
    expected = "sglang" if resolve_sglang_python(None) is not None and gpus_present() else "diffusers"
    assert (args.rollout_backend, args.source_of("rollout_backend")) == (expected, "derived")


def test_an_explicit_diffusers_backend_stays_cli() -> None:
    args = job("rl", "tiny-digits-grpo", rollout_backend="diffusers").args
    assert (args.rollout_backend, args.source_of("rollout_backend")) == ("diffusers", "cli")


def test_sglang_with_a_missing_python_names_the_flag(tmp_path: Path) -> None:
    missing = tmp_path / "nonexistent"
    message = config_error("rl", "tiny-digits-grpo", rollout_backend="sglang", sglang_python=str(missing))
    assert "--sglang-python" in message
    assert str(missing) in message
    assert "no such file" in message


def test_sglang_is_rejected_for_dmd2(fake_python: Path) -> None:
    message = config_error("dmd2", "tiny-digits-4step", rollout_backend="sglang", sglang_python=str(fake_python))
    assert "train dmd2" in message
    assert "--rollout-backend" in message


def test_sglang_derives_the_miles_router(fake_python: Path) -> None:
    args = job("rl", "tiny-digits-grpo", rollout_backend="sglang", sglang_python=str(fake_python)).args
    assert (args.rollout_backend, args.source_of("rollout_backend")) == ("sglang", "cli")
    assert (args.use_miles_router, args.source_of("use_miles_router")) == (True, "derived")


def test_sglang_with_the_router_turned_off_is_rejected(fake_python: Path) -> None:
    message = config_error(
        "rl", "tiny-digits-grpo", rollout_backend="sglang", sglang_python=str(fake_python), use_miles_router=False
    )
    assert "--use-miles-router" in message
    assert "miles router" in message


def test_rollout_num_engines_sets_the_engine_count() -> None:
    from miles.rollout.manager import num_engines

    args = job("rl", "tiny-digits-grpo", rollout_num_engines=3).args
    assert args.rollout_num_engines == 3
    assert num_engines(args) == 3


# ---------------------------------------------------------------------------- find_engine_failure


class EngineDied(EngineFailure):
    pass


class FakeRayTaskError(Exception):
    """Like Ray's task error: the original exception kept as `.cause`."""

    def __init__(self, text: str, cause: BaseException | None) -> None:
        super().__init__(text)
        self.cause = cause


def test_engine_failure_itself() -> None:
    assert find_engine_failure(EngineDied("engine 1 (pid 42) died")) == "engine 1 (pid 42) died"


def test_engine_failure_as_cause_attribute() -> None:
    wrapped = FakeRayTaskError("ray: task failed\nTraceback ...", EngineDied("engine 2 at http://h:1 died"))
    assert find_engine_failure(wrapped) == "engine 2 at http://h:1 died"


def test_engine_failure_two_levels_down() -> None:
    inner = FakeRayTaskError("inner", EngineDied("engine 0 hung"))
    assert find_engine_failure(FakeRayTaskError("outer", inner)) == "engine 0 hung"


def test_engine_failure_via_dunder_cause() -> None:
    try:
        try:
            raise EngineDied("engine 3 exited with code 1")
        except EngineDied as exc:
            raise RuntimeError("rollout failed") from exc
    except RuntimeError as outer:
        assert find_engine_failure(outer) == "engine 3 exited with code 1"


def test_engine_failure_text_marker() -> None:
    text = "ActorDiedError: the actor died\nTraceback:\n  ...\nRolloutEngineError: engine 4 never got healthy\nmore"
    assert find_engine_failure(RuntimeError(text)) == "engine 4 never got healthy"


def test_unrelated_errors_are_no_engine_failure() -> None:
    assert find_engine_failure(ValueError("bad value")) is None
    assert find_engine_failure(FakeRayTaskError("task failed", ValueError("bad"))) is None
    cyclic = RuntimeError("a")
    other = RuntimeError("b")
    cyclic.__cause__, other.__cause__ = other, cyclic
    assert find_engine_failure(cyclic) is None


def test_lora_adapter_with_mixed_ranks_keeps_each_modules_scaling(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    low = lora_payload({"a.to_q": 1.5}, rank=2)
    high = lora_payload({"a.to_k": 0.5}, rank=4)
    path, alpha = write_lora_adapter({**low, **high}, tmp_path, 1)
    assert alpha == 4  # the largest rank
    tensors = load_file(str(path))
    for payload, module in ((low, "a.to_q"), (high, "a.to_k")):
        a, b = tensors[f"{module}.lora_A.weight"], tensors[f"{module}.lora_B.weight"]
        applied = (alpha / a.shape[0]) * b @ a  # sglang: alpha / this module's rank
        wanted = float(payload[f"{module}.lora_scaling"]) * payload[f"{module}.lora_B"] @ payload[f"{module}.lora_A"]
        assert torch.allclose(applied, wanted, atol=1e-6)
    # and what the engine must then hold, under its wrapped names
    from miles.rollout.engines.sglang.sync import expected_sha256, lora_expected_sha256, merged_lora_weight

    base = {
        "a.to_q.weight": torch.randn(6, 5),
        "a.to_q.bias": torch.randn(6),
        "a.to_k.weight": torch.randn(6, 5),
        "norm.weight": torch.randn(5),
    }
    save_file(base, str(tmp_path / "diffusion_pytorch_model.safetensors"))
    expected = lora_expected_sha256(
        [tmp_path / "diffusion_pytorch_model.safetensors"],
        expected_sha256(base, torch.float32),
        path,
        alpha,
        {"a.to_q", "a.to_k"},
        torch.float32,
    )
    assert set(expected) == {
        "a.to_q.base_layer.weight",
        "a.to_q.base_layer.bias",
        "a.to_k.base_layer.weight",
        "norm.weight",
    }
    assert expected["a.to_q.base_layer.bias"] == tensor_sha256(base["a.to_q.bias"])
    assert expected["norm.weight"] == tensor_sha256(base["norm.weight"])
    a, b = tensors["a.to_q.lora_A.weight"], tensors["a.to_q.lora_B.weight"]
    merged = base["a.to_q.weight"].clone().add_(b @ a, alpha=alpha / 2)
    assert torch.equal(merged_lora_weight(base["a.to_q.weight"], a, b, alpha / 2), merged)
    assert expected["a.to_q.base_layer.weight"] == tensor_sha256(merged)
    assert expected["a.to_q.base_layer.weight"] != tensor_sha256(base["a.to_q.weight"])


def test_server_command_sleeps_on_idle_only_when_asked() -> None:
    cpu = ServerSpec(python="/nowhere/python", model_path="/m", port=5, sleep_on_idle=True)
    gpu = ServerSpec(python="/nowhere/python", model_path="/m", port=5)
    assert flag_values(cpu.command(scheduler_port=7, master_port=8), "--sleep-on-idle") == []
    assert "--sleep-on-idle" not in gpu.command(scheduler_port=7, master_port=8)


def test_log_tail_keeps_the_last_start_and_its_errors_first(tmp_path: Path) -> None:
    from miles.rollout.engines.sglang.server import SglangServer

    server = SglangServer(ServerSpec(python="/nowhere/python", model_path="/m", name="engine 3"), tmp_path)
    lines = ["$ first start", "ERROR: old failure", "$ second start"]
    lines += [f"line {i}" for i in range(30)]
    lines += ["ERROR:    [Errno 98] error while attempting to bind on address: address already in use"]
    lines += ["warnings.warn(noise)", "kill_process_tree called"]
    server.log_path.write_text("\n".join(lines) + "\n")
    tail = server.log_tail(lines=5).splitlines()
    assert tail[0].endswith("address already in use")
    assert "old failure" not in "\n".join(tail) and "warnings.warn" not in "\n".join(tail)
    assert tail[-1] == "kill_process_tree called" and len(tail) == 6
    from miles.rollout.engines.sglang.rollout import _start_failure

    exc = RuntimeError("sglang engine 3 exited with code 1 while starting (log x):\n" + "\n".join(tail))
    assert _start_failure(exc).endswith("address already in use")
    assert _start_failure(exc).startswith("sglang engine 3 exited with code 1")
