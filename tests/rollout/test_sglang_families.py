"""The sglang adapter of each model family, no server: what a family puts in the server command and the
request, and how it turns what sglang returns (packed latents, its `denoising_env`) into the natural latent
layout and the condition rows its `forward_velocity` reads. Env dicts are shaped like sglang 0.5.23's.
"""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
import torch
from safetensors.torch import save as safetensors_save

from miles.models.families import get_family
from miles.models.flux.config import pack_latents
from miles.models.pipeline_config import TrainPipelineConfig
from miles.rollout.engines.base import GenerateRequest
from miles.rollout.engines.sglang.protocol import parse_response, rollout_payload
from miles.rollout.engines.sglang.server import ServerSpec

T, C = 4, 4  # steps, latent channels
L, D, P = 7, 16, 12  # text tokens, hidden size, pooled size


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _request(**changes: Any) -> GenerateRequest:
    fields: dict[str, Any] = {
        "prompt": "a handwritten 3",
        "metadata": {"label": 3},
        "group_index": 0,
        "indices": [0, 1],
        "seeds": [10, 11],
        "sde_steps": [[0, 2], [0, 2]],
        "num_steps": T,
        "guidance_scale": 3.5,
        "noise_level": 0.7,
        "sde_type": "sde",
        "height": 64,
        "width": 64,
    }
    fields.update(changes)
    return GenerateRequest(**fields)


def _wire(obj: Any) -> Any:
    """sglang's msgpack encoding: tensors as safetensors bytes, tuples as lists."""
    if isinstance(obj, torch.Tensor):
        return {"__tensor__": True, "data": safetensors_save({"t": obj.contiguous()}), "shape": list(obj.shape)}
    if isinstance(obj, dict):
        return {k: _wire(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_wire(v) for v in obj]
    return obj


# ---------------------------------------------------------------------------- latents


@pytest.mark.parametrize("family_name", ["flux", "qwen_image"])
@pytest.mark.parametrize(("height", "width"), [(64, 64), (64, 128), (96, 32)])
def test_packed_engine_latents_unpack_to_the_natural_layout(family_name: str, height: int, width: int) -> None:
    family = get_family(family_name)
    natural = torch.randn(T + 1, C, height // 8, width // 8, generator=_gen(0))
    packed = pack_latents(natural)  # what sglang records: [T+1, (h/2)(w/2), 4C]
    assert packed.shape == (T + 1, (height // 16) * (width // 16), 4 * C)
    back = family.from_engine_latents(packed.to(torch.bfloat16).float(), height, width)
    assert back.shape == natural.shape and back.dtype == torch.float32
    assert torch.equal(back, natural.to(torch.bfloat16).float())
    assert torch.equal(family.from_engine_latents(packed, height, width), natural)
    # already natural (4-d): returned as it is
    assert torch.equal(family.from_engine_latents(natural, height, width), natural)


def test_packed_latents_that_fit_no_grid_are_rejected() -> None:
    with pytest.raises(ValueError, match="fit no 2x2-packed grid of a 64x64 image"):
        get_family("flux").from_engine_latents(torch.zeros(T + 1, 15, 16), 64, 64)


@pytest.mark.parametrize("family_name", ["sd3", None])
def test_sd3_latents_are_taken_as_they_are(family_name: str | None) -> None:
    family = get_family(family_name) if family_name else TrainPipelineConfig()
    latents = torch.randn(T + 1, C, 8, 8, generator=_gen(1)).to(torch.bfloat16)
    out = family.from_engine_latents(latents, 64, 64)
    assert out.dtype == torch.float32 and torch.equal(out, latents.float())


# ---------------------------------------------------------------------------- conditions


def _flux_env(batch: int = 1) -> dict[str, Any]:
    """FluxPipelineConfig.prepare_pos_cond_kwargs after sglang's per-output slicing and serialization."""
    g = _gen(2)
    tokens = 16 + L
    return {
        "pos_cond_kwargs": {
            "freqs_cis": [torch.randn(tokens, 8, generator=g), torch.randn(tokens, 8, generator=g)],
            "pooled_projections": torch.randn(batch, P, generator=g).squeeze(0),
            "encoder_hidden_states": torch.randn(batch, L, D, generator=g).squeeze(0).to(torch.bfloat16),
        },
        "neg_cond_kwargs": None,
        "image_kwargs": None,
        "guidance": torch.tensor(3500.0),  # embedded_cfg_scale * 1000, sliced to the output
    }


def test_flux_conditions_drop_the_rope_table_and_take_guidance_from_the_env() -> None:
    family = get_family("flux")
    env = _flux_env()
    rows = family.from_engine_conditions(env["pos_cond_kwargs"], env)
    assert set(rows) == {"encoder_hidden_states", "pooled_projections", "guidance"} == set(family.condition_inputs)
    assert rows["encoder_hidden_states"].shape == (L, D) and rows["encoder_hidden_states"].dtype == torch.float32
    assert torch.equal(rows["encoder_hidden_states"], env["pos_cond_kwargs"]["encoder_hidden_states"].float())
    assert rows["pooled_projections"].shape == (P,)
    assert rows["guidance"].shape == () and rows["guidance"].item() == 3.5
    # the same row the diffusers engine stores (encode_prompts' [B] guidance, row 0)
    assert torch.equal(rows["guidance"], torch.full((2,), 3.5, dtype=torch.float32)[0])
    # unsliced, with the batch dim of the prompt (one prompt for M outputs): the batch dim goes
    wide = _flux_env(batch=1)
    wide["pos_cond_kwargs"]["pooled_projections"] = wide["pos_cond_kwargs"]["pooled_projections"][None]
    wide["guidance"] = torch.full((1,), 2000.0)
    rows = family.from_engine_conditions(wide["pos_cond_kwargs"], wide)
    assert rows["pooled_projections"].shape == (P,) and rows["guidance"].item() == 2.0


def test_flux_conditions_without_an_env_guidance_have_none() -> None:
    env = _flux_env()
    env["guidance"] = None
    assert "guidance" not in get_family("flux").from_engine_conditions(env["pos_cond_kwargs"], env)


def _qwen_kwargs(mask: Any, txt_seq_lens: list[int]) -> dict[str, Any]:
    """QwenImagePipelineConfig._prepare_cond_kwargs (+ the prompt embeds, one per text encoder) as they
    reach miles: RoPE tables as lists (complex ones too), the embeds a one-tensor list."""
    g = _gen(3)
    return {
        "txt_seq_lens": txt_seq_lens,
        "freqs_cis": [torch.randn(16, 16, generator=g), torch.randn(L, 16, generator=g)],
        "freqs_complex": [
            torch.randn(16, 8, dtype=torch.complex64, generator=g),
            torch.zeros(L, 8).to(torch.complex64),
        ],
        "img_shapes": [[[1, 4, 4]]],
        "encoder_hidden_states_mask": mask,
        "encoder_hidden_states": [torch.randn(L, D, generator=g).to(torch.bfloat16)],
    }


@pytest.mark.parametrize(
    ("mask", "lens", "valid"),
    [
        (None, [L], L),  # one output: the full padded length, no mask
        (None, [L, L, L], L),  # M outputs of one prompt: equal lengths, no mask
        (None, [5, 5], 5),  # lengths shorter than the rows: a mask built from them
        (torch.tensor([True] * 4 + [False] * (L - 4)), [4, 4], 4),  # the server's own mask
    ],
    ids=["single", "equal-lengths", "from-lengths", "server-mask"],
)
def test_qwen_conditions_always_carry_a_float_mask(mask: Any, lens: list[int], valid: int) -> None:
    family = get_family("qwen_image")
    kwargs = _qwen_kwargs(mask, lens)
    rows = family.from_engine_conditions(kwargs, {"pos_cond_kwargs": kwargs})
    assert set(rows) == set(family.condition_inputs) == {"encoder_hidden_states", "encoder_hidden_states_mask"}
    assert rows["encoder_hidden_states"].shape == (L, D) and rows["encoder_hidden_states"].dtype == torch.float32
    assert torch.equal(rows["encoder_hidden_states"], kwargs["encoder_hidden_states"][0].float())
    expected = torch.tensor([1.0] * valid + [0.0] * (L - valid))
    assert rows["encoder_hidden_states_mask"].dtype == torch.float32
    assert torch.equal(rows["encoder_hidden_states_mask"], expected)
    # rows of different lengths collate (padded, mask 0) like the diffusers engine's
    short = {k: v[:5] for k, v in rows.items()}
    batch = family.collate_conditions([rows, short])
    assert batch["encoder_hidden_states"].shape == (2, L, D)
    assert batch["encoder_hidden_states_mask"][1].tolist() == [1.0] * min(5, valid) + [0.0] * (L - min(5, valid))


def test_sd3_conditions_are_every_tensor_as_before() -> None:
    """The base adapter (SD3's): every tensor kept, float32, the prompt's batch dim of 1 dropped; None skipped."""
    g = _gen(4)
    kwargs = {
        "encoder_hidden_states": torch.randn(1, L, D, generator=g).to(torch.bfloat16),
        "pooled_projections": torch.randn(1, P, generator=g),
        "encoder_attention_mask": None,
    }
    for family in (get_family("sd3"), TrainPipelineConfig()):
        rows = family.from_engine_conditions(kwargs, {"pos_cond_kwargs": kwargs})
        assert set(rows) == {"encoder_hidden_states", "pooled_projections"}
        assert torch.equal(rows["encoder_hidden_states"], kwargs["encoder_hidden_states"][0].float())
        assert torch.equal(rows["pooled_projections"], kwargs["pooled_projections"][0])


def test_qwen_images_lose_the_video_vaes_frame_axis() -> None:
    image = torch.rand(3, 1, 64, 64, generator=_gen(5))
    assert torch.equal(get_family("qwen_image").from_engine_image(image), image[:, 0])
    assert torch.equal(get_family("qwen_image").from_engine_image(image[:, 0]), image[:, 0])
    assert get_family("flux").from_engine_image(image[:, 0].to(torch.bfloat16)).dtype == torch.float32


# ---------------------------------------------------------------------------- weights in sglang's layout


def _qwen_block_state() -> dict[str, torch.Tensor]:
    g = _gen(6)
    state = {}
    for proj in ("to_q", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"):
        state[f"transformer_blocks.0.attn.{proj}.weight"] = torch.randn(8, 4, generator=g)
        state[f"transformer_blocks.0.attn.{proj}.bias"] = torch.randn(8, generator=g)
    return state


def test_qwen_text_qkv_is_fused_as_sglang_holds_it() -> None:
    family = get_family("qwen_image")
    assert family.engine_module("transformer_blocks.3.attn.add_k_proj") == (
        "transformer_blocks.3.attn.to_added_qkv",
        [f"transformer_blocks.3.attn.add_{x}_proj" for x in "qkv"],
    )
    assert family.engine_module("transformer_blocks.3.attn.to_q") == (
        "transformer_blocks.3.attn.to_q",
        ["transformer_blocks.3.attn.to_q"],
    )
    state = _qwen_block_state()
    engine = family.to_engine_tensors(state)
    prefix = "transformer_blocks.0.attn."
    assert set(engine) == {
        f"{prefix}{p}.{leaf}" for p in ("to_q", "to_added_qkv", "to_add_out") for leaf in ("weight", "bias")
    }
    qkv = [state[f"{prefix}add_{x}_proj.weight"] for x in "qkv"]
    assert torch.equal(engine[f"{prefix}to_added_qkv.weight"], torch.cat(qkv))
    assert engine[f"{prefix}to_added_qkv.bias"].shape == (24,)
    # the other families keep the names
    assert get_family("flux").to_engine_tensors(state) == state
    with pytest.raises(ValueError, match=r"to_added_qkv\.weight .*add_v_proj"):
        family.to_engine_tensors({k: v for k, v in state.items() if "add_v_proj.weight" not in k})


def test_engine_digests_of_a_fused_family(tmp_path: Any) -> None:
    from safetensors.torch import save_file

    from miles.rollout.engines.sglang import sync as wsync

    family = get_family("qwen_image")
    state = _qwen_block_state()
    names = set(state)
    expected = wsync.engine_sha256(state, torch.float32, family)
    assert expected == wsync.expected_sha256(family.to_engine_tensors(state), torch.float32)
    # read from files, one at a time, with the fused members split across them
    keys = sorted(state)
    save_file({k: state[k] for k in keys[::2]}, str(tmp_path / "a.safetensors"))
    save_file({k: state[k] for k in keys[1::2]}, str(tmp_path / "b.safetensors"))
    files = [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]
    assert wsync.files_engine_sha256(files, names, torch.float32, family) == expected
    assert wsync.files_engine_sha256(files, names, torch.float32) == wsync.expected_sha256(state, torch.float32)

    # LoRA on the text q/k/v and on to_q: each member merged, then fused, under the wrapped names
    g = _gen(7)
    pairs = {
        f"transformer_blocks.0.attn.{p}": (torch.randn(2, 4, generator=g), torch.randn(8, 2, generator=g))
        for p in ("to_q", "add_q_proj", "add_k_proj", "add_v_proj")
    }
    linears = {k.rpartition(".")[0] for k in state}
    digests = wsync.lora_merged_sha256(files, expected, pairs, 4, linears, torch.float32, family=family)
    merged = dict(state)
    for module, (a, b) in pairs.items():
        merged[f"{module}.weight"] = wsync.merged_lora_weight(state[f"{module}.weight"], a, b, 4 / 2)
    want = wsync.engine_sha256(merged, torch.float32, family)
    assert digests == {
        k.replace(".weight", ".base_layer.weight").replace(".bias", ".base_layer.bias"): v for k, v in want.items()
    }


# ---------------------------------------------------------------------------- requests and server options


@pytest.mark.parametrize(
    ("family_name", "guidance", "true_cfg", "fields"),
    [
        ("sd3", 4.5, None, {"guidance_scale": 4.5}),
        ("flux", 3.5, None, {"guidance_scale": 3.5, "true_cfg_scale": 1.0}),  # embedded only: one branch
        ("flux", 3.5, 2.0, {"guidance_scale": 3.5, "true_cfg_scale": 2.0}),  # true CFG beside it
        ("qwen_image", 4.0, None, {"guidance_scale": 4.0, "true_cfg_scale": 4.0}),  # falls back to guidance
        ("qwen_image", 1.0, 5.0, {"guidance_scale": 1.0, "true_cfg_scale": 5.0}),
    ],
)
def test_request_guidance_fields_per_family(
    family_name: str, guidance: float, true_cfg: float | None, fields: dict[str, float]
) -> None:
    family = get_family(family_name)
    assert family.sglang_request_fields(guidance, true_cfg) == fields
    payload = rollout_payload(_request(guidance_scale=guidance, true_cfg_scale=true_cfg), family=family)
    assert {k: payload[k] for k in payload if k in ("guidance_scale", "true_cfg_scale")} == fields
    # sglang's rule (SamplingParams.should_use_classifier_free_guidance, get_classifier_free_guidance_scale)
    # gives the family's two-branch scale
    sglang_scale = fields.get("true_cfg_scale", fields["guidance_scale"])
    assert sglang_scale == family.cfg_scale(guidance, true_cfg)


@pytest.mark.parametrize(
    ("family_name", "extra"), [("sd3", None), ("flux", {"max_sequence_length": 8}), ("qwen_image", None)]
)
def test_only_flux_sends_the_checkpoints_text_length(family_name: str, extra: dict[str, int] | None) -> None:
    """sglang pads FLUX's T5 to 512 unless the request says otherwise (CLIP stays at 77); SD3's override would
    reach its CLIP encoders too and Qwen-Image's would pad its prompt template, so they send none."""
    payload = rollout_payload(_request(), family=get_family(family_name), max_sequence_length=8)
    assert payload.get("extra_sampling_params") == extra
    assert "extra_sampling_params" not in rollout_payload(_request(), family=get_family(family_name))


def test_the_default_payload_is_sd3s() -> None:
    req = _request(guidance_scale=4.5)
    assert rollout_payload(req) == rollout_payload(req, family=get_family("sd3"))
    assert "true_cfg_scale" not in rollout_payload(req)


@pytest.mark.parametrize(
    ("family_name", "options"),
    [
        ("sd3", {"text_encoder_precisions": ["bf16"] * 3}),
        ("flux", {"text_encoder_precisions": ["bf16"] * 2, "embedded_cfg_scale": 3.5}),
        ("qwen_image", {"text_encoder_precisions": ["bf16"]}),
    ],
)
def test_server_options_per_family(family_name: str, options: dict[str, Any]) -> None:
    family = get_family(family_name)
    assert family.sglang_server_options("bf16", 3.5) == options
    spec = ServerSpec(python="/nowhere/python", model_path="/m", port=5, precision="bf16", family_options=options)
    argv = spec.command(scheduler_port=6, master_port=7)
    assert _flag_values(argv, "--text-encoder-precisions") == options["text_encoder_precisions"]
    embedded = options.get("embedded_cfg_scale")
    assert _flag_values(argv, "--embedded-cfg-scale") == ([] if embedded is None else [str(embedded)])


def _flag_values(argv: list[str], flag: str) -> list[str]:
    """The values after `flag` up to the next flag ([] when absent)."""
    if flag not in argv:
        return []
    values = []
    for item in argv[argv.index(flag) + 1 :]:
        if item.startswith("--"):
            break
        values.append(item)
    return values


def test_each_family_names_its_sglang_model_id() -> None:
    assert get_family("sd3").sglang_model_id == "stable-diffusion-3-medium-diffusers"
    assert get_family("flux").sglang_model_id == "FLUX.1-dev"
    assert get_family("qwen_image").sglang_model_id == "Qwen-Image"


# ---------------------------------------------------------------------------- a whole flux response


def _flux_output(b: int, negative: bool) -> dict[str, Any]:
    g = _gen(100 + b)
    sigmas = torch.linspace(1.0, 0.0, T + 1)
    env = _flux_env()
    if negative:
        env["neg_cond_kwargs"] = {k: v for k, v in _flux_env()["pos_cond_kwargs"].items()}
        env["neg_cond_kwargs"]["encoder_hidden_states"] = torch.randn(L, D, generator=g)
    return {
        "generated_output": torch.rand(3, 64, 64, generator=g),
        "rollout_log_probs": torch.randn(T, generator=g),
        "dit_trajectory": {
            "latents": torch.randn(T + 1, 16, 4 * C, generator=g),
            "timesteps": sigmas * 1000,
            "sigmas": sigmas,
        },
        "denoising_env": env,
    }


@pytest.mark.parametrize("true_cfg", [None, 2.0])
def test_a_flux_response_becomes_samples_in_the_natural_layout(true_cfg: float | None) -> None:
    family = get_family("flux")
    req = _request(true_cfg_scale=true_cfg)
    sent = [_flux_output(0, true_cfg is not None), _flux_output(1, true_cfg is not None)]
    samples = parse_response(req, msgpack.packb(_wire(sent), use_bin_type=True), family)
    for sample, out in zip(samples, sent, strict=True):
        traj = sample.trajectory
        assert traj.latents.shape == (T + 1, C, 8, 8)
        assert torch.equal(pack_latents(traj.latents), out["dit_trajectory"]["latents"])
        cond = sample.conditions
        assert cond.positive["guidance"].item() == 3.5
        if true_cfg is None:  # embedded guidance alone: one branch, stored as CFG scale 1
            assert cond.negative is None and cond.guidance_scale == 1.0
        else:
            assert cond.guidance_scale == 2.0 and set(cond.negative) == set(family.condition_inputs)
