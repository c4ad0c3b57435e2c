"""wan2_2 on `--rollout-backend sglang`, without a server: the request fields sglang 0.5.23's Wan pipeline reads,
responses in the natural 5-D / video layout, and the weight sync of both experts (full and LoRA) under the
names sglang's Wan DiT gives its parameters. (A server cannot run Wan on a CPU: `sglang_cpu_blocker`.)"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from miles.models.families import get_family
from miles.rollout.engines.base import GenerateRequest
from miles.rollout.engines.sglang.protocol import rollout_payload, samples_from_outputs
from miles.rollout.engines.sglang.sync import (
    WEIGHTS_FILE,
    checker_body,
    disk_update_body,
    engine_sha256,
    files_engine_sha256,
    lora_expected_sha256,
    merged_lora_weight,
    set_lora_body,
    split_targets,
    sync_targets,
    tensor_sha256,
    transformer_layout,
    write_expert_lora_adapters,
    write_expert_weights,
)

WAN = get_family("wan2_2")
# the parameter names of sglang 0.5.23's WanTransformer3DModel built from a one-block Wan config (read off the
# module itself; tests/sglang/test_sglang_wan.py rebuilds it in the sglang environment and compares)
SGLANG_ONE_BLOCK = {
    "scale_shift_table",
    "patch_embedding.proj.weight",
    "patch_embedding.proj.bias",
    "condition_embedder.time_embedder.mlp.fc_in.weight",
    "condition_embedder.time_embedder.mlp.fc_in.bias",
    "condition_embedder.time_embedder.mlp.fc_out.weight",
    "condition_embedder.time_embedder.mlp.fc_out.bias",
    "condition_embedder.time_modulation.linear.weight",
    "condition_embedder.time_modulation.linear.bias",
    "condition_embedder.text_embedder.fc_in.weight",
    "condition_embedder.text_embedder.fc_in.bias",
    "condition_embedder.text_embedder.fc_out.weight",
    "condition_embedder.text_embedder.fc_out.bias",
    "blocks.0.scale_shift_table",
    *(f"blocks.0.{m}.{p}" for m in ("to_q", "to_k", "to_v", "to_out") for p in ("weight", "bias")),
    "blocks.0.norm_q.weight",
    "blocks.0.norm_k.weight",
    "blocks.0.self_attn_residual_norm.norm.weight",
    "blocks.0.self_attn_residual_norm.norm.bias",
    *(f"blocks.0.attn2.{m}.{p}" for m in ("to_q", "to_k", "to_v", "to_out") for p in ("weight", "bias")),
    "blocks.0.attn2.norm_q.weight",
    "blocks.0.attn2.norm_k.weight",
    *(f"blocks.0.ffn.{m}.{p}" for m in ("fc_in", "fc_out") for p in ("weight", "bias")),
    "proj_out.weight",
    "proj_out.bias",
}


def one_block_expert(seed: int) -> torch.nn.Module:
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=4,
        out_channels=4,
        text_dim=32,
        freq_dim=32,
        ffn_dim=64,
        num_layers=1,
        cross_attn_norm=True,
        rope_max_seq_len=32,
    ).eval()


@pytest.fixture(scope="module")
def wan_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The experts' subfolders of a Wan2.2 checkpoint: two one-block experts with different weights."""
    root = tmp_path_factory.mktemp("wan_ck")
    for seed, name in enumerate(("transformer", "transformer_2")):
        one_block_expert(seed).save_pretrained(root / name)
    return root


def experts_state(checkpoint: Path) -> dict[str, torch.Tensor]:
    state = {}
    for name in ("transformer", "transformer_2"):
        for key, value in load_file(str(checkpoint / name / WEIGHTS_FILE)).items():
            state[f"{name}.{key}"] = value
    return state


def request(**overrides) -> GenerateRequest:
    fields = dict(
        prompt="a red four",
        metadata={},
        group_index=0,
        indices=[0, 1],
        seeds=[7, 8],
        sde_steps=[[1, 2], [1, 2]],
        num_steps=4,
        guidance_scale=4.0,
        noise_level=0.7,
        sde_type="sde",
        height=64,
        width=64,
        num_frames=9,
        fps=16.0,
        guidance_scale_2=3.0,
    )
    fields.update(overrides)
    return GenerateRequest(**fields)


# ---- requests ----------------------------------------------------------------------------------
def test_wan_request_carries_frames_fps_and_the_low_noise_scale() -> None:
    payload = rollout_payload(request(), family=WAN, max_sequence_length=512)
    assert payload["num_frames"] == 9 and payload["fps"] == 16 and isinstance(payload["fps"], int)
    assert payload["guidance_scale"] == 4.0 and "true_cfg_scale" not in payload
    # sglang's RolloutRequest has no guidance_scale_2: it merges extra_sampling_params into SamplingParams
    assert payload["extra_sampling_params"] == {"max_sequence_length": 512, "guidance_scale_2": 3.0}
    assert payload["rollout_sde_step_indices"] == [1, 2]


def test_wan_low_noise_scale_defaults_to_the_guidance_scale_not_sglangs_3() -> None:
    payload = rollout_payload(request(guidance_scale_2=None, guidance_scale=5.0), family=WAN, max_sequence_length=512)
    assert payload["extra_sampling_params"]["guidance_scale_2"] == 5.0


def test_fractional_fps_is_left_out_and_image_families_send_no_video_fields() -> None:
    assert "fps" not in rollout_payload(request(fps=7.5), family=WAN)
    sd3 = rollout_payload(request(num_frames=1, fps=None, guidance_scale_2=None), family=None, max_sequence_length=8)
    assert not {"num_frames", "fps"} & set(sd3) and "extra_sampling_params" not in sd3
    flux = rollout_payload(request(num_frames=1, fps=None, guidance_scale_2=None), "cpu", get_family("flux"), 8)
    assert not {"num_frames", "fps"} & set(flux) and "guidance_scale_2" not in flux["extra_sampling_params"]


def test_wan_refusals_name_the_exact_reason() -> None:
    assert "fused_norm_scale_shift_cpu" in WAN.sglang_cpu_blocker and "sgl_kernel" in WAN.sglang_cpu_blocker
    assert WAN.sglang_blocker(4.0, None, 512) == ""
    why = WAN.sglang_blocker(1.0, None, 16)  # with or without CFG: both branches see the padding
    assert "512" in why and "16" in why


# ---- responses ---------------------------------------------------------------------------------
def outputs(frames: int, latent_frames: int, steps: int = 4, text: int = 512) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    outs = []
    for _ in range(2):
        env = {
            "pos_cond_kwargs": {
                "encoder_hidden_states": torch.randn(1, text, 32, generator=gen, dtype=torch.bfloat16),
                "encoder_hidden_states_image": None,
            },
            "neg_cond_kwargs": {"encoder_hidden_states": torch.zeros(1, text, 32)},
            "image_kwargs": {},
            "guidance": None,
        }
        outs.append(
            {
                "generated_output": torch.rand(3, frames, 64, 64, generator=gen),
                "rollout_log_probs": torch.randn(steps, generator=gen),
                "dit_trajectory": {
                    "latents": torch.randn(steps + 1, 4, latent_frames, 8, 8, generator=gen),
                    "timesteps": torch.tensor([999.0, 990.0, 970.0, 900.0, 0.0]),
                    "sigmas": torch.tensor([0.999, 0.99, 0.97, 0.9, 0.0]),
                },
                "denoising_env": env,
            }
        )
    return outs


def test_wan_response_is_a_video_sample_with_5d_latents_and_both_scales() -> None:
    outs = outputs(frames=9, latent_frames=3)
    samples = samples_from_outputs(request(), outs, WAN)
    for s, out in zip(samples, outs, strict=True):
        assert s.image.shape == (3, 9, 64, 64) and s.image.dtype == torch.float32
        traj, cond = s.trajectory, s.conditions
        assert traj.latents.shape == (5, 4, 3, 8, 8) and torch.equal(traj.latents, out["dit_trajectory"]["latents"])
        assert torch.equal(traj.log_probs, out["rollout_log_probs"][[1, 2]])
        assert traj.timesteps.shape == (4,)
        assert set(cond.positive) == {"encoder_hidden_states"} and set(cond.negative) == {"encoder_hidden_states"}
        assert cond.positive["encoder_hidden_states"].shape == (512, 32)
        assert cond.positive["encoder_hidden_states"].dtype == torch.float32
        assert cond.guidance_scale == 4.0 and cond.guidance_scale_2 == 3.0


def test_one_frame_is_an_image_and_no_cfg_keeps_no_second_scale() -> None:
    (s, _) = samples_from_outputs(request(num_frames=1, guidance_scale=1.0), outputs(frames=1, latent_frames=1), WAN)
    assert s.image.shape == (3, 64, 64)  # as decode_latents gives one frame
    assert s.trajectory.latents.shape == (5, 4, 1, 8, 8)
    assert s.conditions.negative is None and s.conditions.guidance_scale == 1.0
    assert s.conditions.guidance_scale_2 is None  # as the diffusers engine stores it without CFG


def test_a_packed_or_image_latent_is_refused() -> None:
    outs = outputs(frames=1, latent_frames=1)
    for out in outs:
        out["dit_trajectory"]["latents"] = out["dit_trajectory"]["latents"][:, :, 0]
    with pytest.raises(ValueError, match=r"\[T\+1, C, frames, h, w\]"):
        samples_from_outputs(request(num_frames=1), outs, WAN)


# ---- weight sync of both experts -------------------------------------------------------------------
def test_wan_expert_names_are_sglangs(wan_checkpoint: Path) -> None:
    params, linears = transformer_layout(wan_checkpoint, "transformer_2")
    state = load_file(str(wan_checkpoint / "transformer_2" / WEIGHTS_FILE))
    engine = WAN.to_engine_tensors({k: v for k, v in state.items() if k in params})
    assert set(engine) == SGLANG_ONE_BLOCK
    assert torch.equal(engine["blocks.0.to_out.weight"], state["blocks.0.attn1.to_out.0.weight"])
    assert {WAN.engine_module(m)[0] for m in linears} >= {"blocks.0.to_q", "blocks.0.ffn.fc_in", "proj_out"}


def test_full_sync_of_both_experts_writes_loads_and_checks_each(wan_checkpoint: Path, tmp_path: Path) -> None:
    assert sync_targets(WAN) == ("transformer", "transformer_2") and sync_targets(None) == ("transformer",)
    state = experts_state(wan_checkpoint)
    state["transformer_2.proj_out.bias"] = state["transformer_2.proj_out.bias"] + 0.5
    path, targets = write_expert_weights(state, tmp_path, 3, torch.bfloat16, sync_targets(WAN))
    assert targets == ("transformer", "transformer_2")
    assert disk_update_body(str(path), targets) == {
        "model_path": str(path),
        "target_modules": ["transformer", "transformer_2"],
    }
    for target, tensors in split_targets(state, targets).items():
        written = load_file(str(path / target / WEIGHTS_FILE))
        assert set(written) == set(tensors) and all(v.dtype == torch.bfloat16 for v in written.values())
        params, _ = transformer_layout(wan_checkpoint, target)
        digests = engine_sha256({k: v for k, v in tensors.items() if k in params}, torch.bfloat16, WAN)
        assert set(digests) == SGLANG_ONE_BLOCK
        # what the engine then recomputes from the written file (sglang loads it under its names)
        assert files_engine_sha256([path / target / WEIGHTS_FILE], params, torch.bfloat16, WAN) == digests
        assert checker_body(digests, target)["target_module"] == target
    assert torch.equal(
        load_file(str(path / "transformer_2" / WEIGHTS_FILE))["proj_out.bias"],
        state["transformer_2.proj_out.bias"].to(torch.bfloat16),
    )
    with pytest.raises(KeyError, match="belongs to no synced module"):
        split_targets({"vae.w": torch.zeros(1)}, targets)


def test_lora_sync_of_both_experts(wan_checkpoint: Path, tmp_path: Path) -> None:
    from peft import LoraConfig, inject_adapter_in_model

    from miles.models.lora_sync import lora_sync_payload
    from miles.models.wan2_2.experts import WanExperts

    experts = WanExperts(
        {name: one_block_expert(seed) for seed, name in enumerate(("transformer", "transformer_2"))}, 875.0
    )
    model = inject_adapter_in_model(
        LoraConfig(r=4, lora_alpha=8, target_modules=list(WAN.lora_target_modules)), copy.deepcopy(experts)
    )
    gen = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data = torch.randn(p.shape, generator=gen) * 0.2
    payload = lora_sync_payload(model)
    assert {k.partition(".")[0] for k in payload} == {"transformer", "transformer_2"}
    written = write_expert_lora_adapters(payload, tmp_path, 2, sync_targets(WAN))
    assert set(written) == {"transformer", "transformer_2"}
    body = set_lora_body({t: (str(p), a) for t, (p, a) in written.items()}, "miles-v2")
    assert body["target"] == ["transformer", "transformer_2"]
    assert body["lora_nickname"] == ["miles-v2-transformer", "miles-v2-transformer_2"]
    assert body["lora_alpha"] == [8, 8] and body["merge_mode"] == "merge"
    for target, (path, alpha) in written.items():
        adapter = load_file(str(path))
        # diffusers' module names, without the expert: sglang maps them onto its DiT as it loads the adapter
        assert "blocks.0.attn1.to_q.lora_A.weight" in adapter and "blocks.0.ffn.net.2.lora_B.weight" in adapter
        assert not any(k.startswith(target + ".") for k in adapter)
        params, linears = transformer_layout(wan_checkpoint, target)
        base = [wan_checkpoint / target / WEIGHTS_FILE]
        base_sha = files_engine_sha256(base, params, torch.float32, WAN)
        expected = lora_expected_sha256(base, base_sha, path, alpha, linears, torch.float32, WAN)
        assert len(expected) == len(SGLANG_ONE_BLOCK)  # every parameter of the expert
        # sglang wraps the blocks' and proj_out's linears, not the embedders' (exclude_lora_layers)
        assert "blocks.0.to_q.base_layer.weight" in expected and "proj_out.base_layer.weight" in expected
        assert "condition_embedder.text_embedder.fc_in.weight" in expected
        assert "scale_shift_table" in expected
        # the adapted weight holds this expert's own merge
        w = load_file(str(base[0]))["blocks.0.attn1.to_q.weight"]
        a = payload[f"{target}.blocks.0.attn1.to_q.lora_A"]
        b = payload[f"{target}.blocks.0.attn1.to_q.lora_B"]
        assert expected["blocks.0.to_q.base_layer.weight"] == tensor_sha256(merged_lora_weight(w, a, b, alpha / 4))
        assert expected["blocks.0.norm_q.weight"] == base_sha["blocks.0.norm_q.weight"]
