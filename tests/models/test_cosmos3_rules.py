"""cosmos3's rules and adapters that need no model: the microgroup refusal, the LoRA targets, the schedule,
the sglang server options and the conditions sglang's env carries."""

from __future__ import annotations

import pytest
import torch

from miles.config.resolve import resolve
from miles.core.errors import ConfigError
from miles.models.families import resolve_family

BASE = {
    "hf_checkpoint": "nvidia/Cosmos3-Nano",
    "prompt_data": "digits:train",
    "rm_type": "digit",
    "rollout_batch_size": 2,
    "n_samples_per_prompt": 4,
    "diffusion_num_sde_steps": 1,
    "actor_num_gpus_per_node": 1,
    "num_gpus_per_node": 1,
}


def test_checkpoint_names_select_cosmos3() -> None:
    for name in ("nvidia/Cosmos3-Nano", "nvidia/Cosmos3-Nano-Policy-DROID", "tiny-cosmos3"):
        assert resolve_family(name, env={}).name == "cosmos3"


def test_a_microgroup_of_more_than_one_sample_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError) as err:
        resolve("rl", cli={**BASE, "rollout_microgroup_size": 4})
    msg = str(err.value)
    assert "--rollout-microgroup-size" in msg and "one sample at a time" in msg and "\n" not in msg
    assert resolve("rl", cli={**BASE, "rollout_microgroup_size": 1}).args.rollout_microgroup_size == 1


def test_video_flags_are_honoured() -> None:
    args = resolve("rl", cli={**BASE, "diffusion_output_num_frames": 9, "diffusion_fps": 8.0}).args
    assert args.diffusion_output_num_frames == 9 and args.diffusion_fps == 8.0


def test_lora_targets_are_the_generation_path() -> None:
    family = resolve_family("nvidia/Cosmos3-Nano", env={})
    assert set(family.lora_target_modules) == {
        "add_q_proj",
        "add_k_proj",
        "add_v_proj",
        "to_add_out",
        "mlp_moe_gen.gate_proj",
        "mlp_moe_gen.up_proj",
        "mlp_moe_gen.down_proj",
    }
    assert not family.cfg_batching and family.condition_inputs == ("text_ids", "text_mask", "fps")


def test_the_schedule_is_unipcs_own_grid_with_euler_timesteps() -> None:
    from diffusers import UniPCMultistepScheduler

    from miles.builtin.tiny.cosmos3 import SCHEDULER_CONFIG

    family = resolve_family("tiny-cosmos3", env={})
    unipc = UniPCMultistepScheduler(**SCHEDULER_CONFIG)
    sigmas, timesteps = family.schedule(unipc, 10, (2, 1, 8, 8))
    unipc.set_timesteps(10)
    assert torch.equal(sigmas, unipc.sigmas.float()) and sigmas[-1] == 0 and sigmas.shape == (11,)
    # flow_shift 5 on 10 steps (families.md): 1, .978, .952, ..., .557, .359, 0
    assert [round(v, 3) for v in sigmas[[1, 2, 8, 9]].tolist()] == [0.978, 0.952, 0.557, 0.359]
    assert torch.allclose(timesteps, sigmas[:-1] * 1000) and timesteps.dtype == torch.float32
    # --diffusion-flow-shift replaces the checkpoint's shift
    shifted, _ = family.schedule(unipc, 10, (2, 1, 8, 8), flow_shift=1.0)
    assert abs(shifted[9].item() - 0.1) < 0.01


def test_sglang_server_gets_no_text_encoder_precisions_and_the_guardrail_switch() -> None:
    from miles.rollout.engines.sglang.engine import server_spec

    cli = {**BASE, "rollout_backend": "sglang", "num_gpus_per_node": 2, "diffusion_forward_dtype": "bf16"}
    args = resolve("rl", cli=cli).args
    spec = server_spec(args, "engine 0", "/usr/bin/python3", "/models/cosmos3", {"X": "1"})
    argv = spec.command(scheduler_port=1, master_port=2)
    assert "--text-encoder-precisions" not in argv and "--model-id" not in argv  # detected by its class name
    assert spec.env == {"SGLANG_DISABLE_COSMOS3_GUARDRAILS": "1", "X": "1"}


def test_conditions_from_sglangs_env_are_the_engines_rows() -> None:
    family = resolve_family("tiny-cosmos3", env={})
    ids = torch.tensor([[5, 7, 9, 11]])
    rows = family.from_engine_conditions({"text_ids": ids, "text_mask": torch.ones(1, 4), "fps": 8.0})
    assert rows["text_ids"].tolist() == [5.0, 7.0, 9.0, 11.0] and rows["text_ids"].dtype == torch.float32
    assert rows["text_mask"].tolist() == [1.0] * 4 and rows["fps"].tolist() == [8.0]
    no_mask = family.from_engine_conditions({"text_ids": ids}, {"fps": torch.tensor([24.0])})
    assert no_mask["text_mask"].tolist() == [1.0] * 4 and no_mask["fps"].tolist() == [24.0]
    with pytest.raises(ValueError, match="no text_ids"):
        family.from_engine_conditions({"text_mask": torch.ones(1, 4)})


def test_sglang_serves_cosmos3_at_bf16_only() -> None:
    cli = {**BASE, "rollout_backend": "sglang", "num_gpus_per_node": 2}
    with pytest.raises(ConfigError) as err:
        resolve("rl", cli={**cli, "diffusion_forward_dtype": "fp32"})
    msg = str(err.value)
    assert "--diffusion-forward-dtype fp32" in msg and "bf16 only" in msg and "\n" not in msg
    assert resolve("rl", cli={**cli, "diffusion_forward_dtype": "bf16"}).args.rollout_backend == "sglang"
