"""`miles export --comfyui`'s key conversion, checked against diffusers' own readers of those formats (no model).

Wan2.2 and LTX-2 files are read back by diffusers' converters from the original checkpoints' LoRA names (the
format ComfyUI's Wan and LTX models use), which must give back our adapter: the same modules, and for Wan (whose
reader applies the alpha) the same update alpha / rank * B @ A. SD3, Flux and Qwen-Image keep diffusers' names,
which ComfyUI maps itself, plus an alpha per module. Cosmos3 is refused: ComfyUI's core has no model for it.
"""

from __future__ import annotations

import pytest
import torch

from miles.core.errors import ConfigError
from miles.models.families import get_family
from miles.training.export_comfyui import comfyui_state, write_comfyui_lora

RANK, ALPHA, DIM = 4, 8.0, 16


def _adapter(modules: list[str]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for module in modules:
        out[f"transformer.{module}.lora_A.weight"] = torch.randn(RANK, DIM, generator=g)
        out[f"transformer.{module}.lora_B.weight"] = torch.randn(DIM, RANK, generator=g)
    return out


def _update(state: dict[str, torch.Tensor], module: str, scale: float) -> torch.Tensor:
    return scale * state[f"{module}.lora_B.weight"] @ state[f"{module}.lora_A.weight"]


def test_wan_files_read_back_by_diffusers_give_the_same_updates() -> None:
    from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_wan_lora_to_diffusers

    targets = get_family("wan2_2").lora_target_modules
    modules = [f"blocks.{i}.{t}" for i in range(2) for t in targets]
    adapter = _adapter(modules)
    comfy = comfyui_state(get_family("wan2_2"), adapter, ALPHA)
    assert "diffusion_model.blocks.1.self_attn.q.lora_A.weight" in comfy
    assert "diffusion_model.blocks.0.ffn.0.lora_B.weight" in comfy
    assert comfy["diffusion_model.blocks.0.cross_attn.o.alpha"].item() == ALPHA
    back = _convert_non_diffusers_wan_lora_to_diffusers({k: v.clone() for k, v in comfy.items()})  # it scales in place
    back = {k.removeprefix("transformer."): v for k, v in back.items()}
    assert set(back) == {k.removeprefix("transformer.") for k in adapter}
    ours = {k.removeprefix("transformer."): v for k, v in adapter.items()}
    for module in modules:  # diffusers folds alpha / rank into A and B; peft applied it as a scale
        assert torch.allclose(_update(back, module, 1.0), _update(ours, module, ALPHA / RANK), atol=1e-5)


def test_ltx_files_read_back_by_diffusers_give_the_same_modules() -> None:
    from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_ltx2_lora_to_diffusers

    targets = get_family("ltx").lora_target_modules
    modules = [f"transformer_blocks.{i}.attn1.{t}" for i in range(2) for t in targets[:4]]
    modules += [f"transformer_blocks.{i}.ff.{t}" for i in range(2) for t in targets[4:]]
    adapter = _adapter(modules)
    comfy = comfyui_state(get_family("ltx"), adapter, ALPHA)
    assert all(k.startswith("diffusion_model.transformer_blocks.") for k in comfy)
    back = _convert_non_diffusers_ltx2_lora_to_diffusers({k: v for k, v in comfy.items() if not k.endswith("alpha")})
    back = {k.removeprefix("transformer."): v for k, v in back.items()}
    assert set(back) == {k.removeprefix("transformer.") for k in adapter}


@pytest.mark.parametrize("family", ["sd3", "flux", "qwen_image"])
def test_mmdit_flux_and_qwen_keep_diffusers_names_with_an_alpha(family: str) -> None:
    adapter = _adapter(["transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_k"])
    comfy = comfyui_state(get_family(family), adapter, ALPHA)
    alphas = {k for k in comfy if k.endswith(".alpha")}
    assert set(comfy) - alphas == set(adapter)
    assert alphas == {
        "transformer.transformer_blocks.0.attn.to_q.alpha",
        "transformer.transformer_blocks.0.attn.to_k.alpha",
    }
    assert all(comfy[k].item() == ALPHA for k in alphas)


def test_a_wan_module_outside_the_blocks_and_cosmos3_are_refused(tmp_path) -> None:
    with pytest.raises(ConfigError, match="no ComfyUI name for this Wan module"):
        comfyui_state(get_family("wan2_2"), _adapter(["proj_out"]), ALPHA)
    with pytest.raises(ConfigError, match="ComfyUI's core has no Cosmos3 model"):
        write_comfyui_lora(get_family("cosmos3"), tmp_path, tmp_path / "comfyui", ALPHA)


def test_the_files_are_written_per_expert(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    for expert in ("transformer", "transformer_2"):
        (tmp_path / "lora" / expert).mkdir(parents=True)
        save_file(_adapter(["blocks.0.attn1.to_q"]), tmp_path / "lora" / expert / "pytorch_lora_weights.safetensors")
    out = write_comfyui_lora(get_family("wan2_2"), tmp_path / "lora", tmp_path / "comfyui", ALPHA)
    names = sorted(p.name for p in out.iterdir())
    assert names == ["wan2_2_transformer_2_lora.safetensors", "wan2_2_transformer_lora.safetensors"]
    assert "diffusion_model.blocks.0.self_attn.q.alpha" in load_file(out / names[0])
