"""LoRA targets resolve on the real module names: every target of every family's defaults and of every shipped
recipe hits modules of the real-size denoiser, and the trainable counts are what the trainer's `apply_lora` makes."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles.config.resolve import resolve
from miles.memory.cache import cached_counts
from miles.memory.meta_build import LoraSpec, build_denoiser
from miles.memory.shipped import shipped_models
from miles.memory.static import static_memory
from miles.models.families import get_family

MODELS = sorted(shipped_models().items(), key=lambda kv: kv[0].name)
SD35 = next(d for d, _ in MODELS if d.name == "stable-diffusion-3.5-medium")
# trainable parameters of each shipped GPU recipe's trainers (its rank, its targets or the family's)
TRAINABLE = {
    "cosmos3-pickscore-t2i": {"actor": 61_341_696},  # r64, GEN attention only (the recipe's targets)
    "flux-kontext-edit-grpo": {"actor": 216_662_016},  # r64 on flow_grpo's 13 targets (the flux 14 less proj_out)
    "flux-pickscore-grpo": {"actor": 261_689_344},  # r64 (r32: 130,844,672, exactly half)
    "ltx23-pickscore-grpo": {"actor": 616_562_688},  # r64
    "qwen-image-edit-grpo": {"actor": 424_673_280},  # r64 on the qwen_image family's 12 (Qwen-Image's DiT)
    "qwen-image-pickscore-grpo": {"actor": 424_673_280},  # r64
    "sd3-ocr-grpo": {"actor": 18_776_064},  # r32 on the joint attention (attn.*)
    "sd3-pickscore-nft": {"actor": 18_776_064},  # r32
    "sd35-4step": {"critic": 2_243_171_520, "actor": 83_755_008},  # full critic; r64 student, attention + FFNs
    "wan22-i2v-grpo": {"actor": 613_416_960},  # r64, both experts (the I2V experts differ only in the patch embedding)
    "wan22-lora-sft": {"actor": 613_416_960},  # r64, both experts
    "wan22-pickscore-grpo": {"actor": 613_416_960},  # r64, both experts
}


def _matches(name: str, target: str) -> bool:
    """peft's rule for a list of target names: the module's full name, or a suffix after a dot."""
    return name == target or name.endswith("." + target)


@pytest.mark.slow  # builds real-size models on meta: seconds each
@pytest.mark.parametrize("config_dir,model", MODELS, ids=[d.name for d, _ in MODELS])
def test_every_target_hits_real_modules(config_dir: Path, model) -> None:
    import torch

    built = build_denoiser(config_dir, model.family, model.components)
    linears = [n for n, m in built.named_modules() if isinstance(m, torch.nn.Linear)]
    for targets in model.targets:
        for target in targets:
            assert any(_matches(n, target) for n in linears), f"{config_dir.name}: {target!r} hits no nn.Linear"


@pytest.mark.parametrize("recipe", sorted(TRAINABLE))
def test_trainable_parameters_of_the_shipped_recipes(recipe: str) -> None:
    assert static_memory(resolve(None, recipe=recipe)).model.trainable == TRAINABLE[recipe]


def test_sd35_medium_rank_32() -> None:
    """miles' sd3 defaults adapt the joint attention (`attn.*`): 18,776,064 at rank 32. The bare names
    (`to_q`, ..., as memory_estimation.md's run) also hit the 13 dual-attention layers' `attn2`: 23,887,872, the
    reference's count."""
    family = get_family("sd3")
    bare = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
    for targets, expected in ((tuple(family.lora_target_modules), 18_776_064), (bare, 23_887_872)):
        built = build_denoiser(SD35, family, ("transformer",), lora=LoraSpec(32, 64, targets))
        assert sum(p.numel() for p in built.parameters() if p.requires_grad) == expected
    counts = cached_counts(SD35)
    assert sum(a.numel(32) for a in counts.adapters(("transformer",), family.lora_target_modules)) == 18_776_064
