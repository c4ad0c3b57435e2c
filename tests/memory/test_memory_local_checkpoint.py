"""A user's local checkpoint directory goes through the same path as the shipped configs (its own configs, counts
cached under $MILES_HOME/memory), and the meta build's dtypes and sizes equal what the real loaders produce."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from miles.config.resolution import schema_args
from miles.config.resolve import resolve
from miles.memory import cache
from miles.memory.config_dirs import config_dir_for, config_hash
from miles.memory.counts import dtype_name
from miles.memory.load_dtypes import dtype_str
from miles.memory.meta_build import LoraSpec, build_component, build_denoiser
from miles.memory.static import static_memory
from miles.models.families import get_family
from miles.models.loading import torch_dtype


def _bytes_by_dtype(module: torch.nn.Module) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in [*module.parameters(), *module.buffers()]:
        key = dtype_str(t.dtype)
        out[key] = out.get(key, 0) + t.numel() * t.element_size()
    return out


def _signature(module: torch.nn.Module) -> list[tuple[str, tuple[int, ...], torch.dtype, bool]]:
    return [(n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in module.named_parameters()]


@pytest.mark.slow  # the session's tiny-sd3 build (a minute or two cold): not in the fast tier
def test_a_local_checkpoint_is_measured_once_and_cached(tiny_sd3_dir: Path, miles_home: Path, monkeypatch) -> None:
    family = get_family("sd3")
    assert config_dir_for(tiny_sd3_dir, family) == tiny_sd3_dir
    targets = [tuple(family.lora_target_modules)]
    counts = cache.model_counts(tiny_sd3_dir, family, ("transformer",), targets)
    stored = cache.cache_path(config_hash(tiny_sd3_dir))
    assert (
        stored.parent == miles_home / "memory" and json.loads(stored.read_text())["config_hash"] == counts.config_hash
    )

    def no_measuring(*args, **kwargs):
        raise AssertionError("measured again instead of reading the cache")

    monkeypatch.setattr("miles.memory.measure.measure", no_measuring)
    monkeypatch.setattr("miles.memory.measure.measure_denoiser", no_measuring)
    assert cache.model_counts(tiny_sd3_dir, family, ("transformer",), targets).to_json() == counts.to_json()


@pytest.mark.slow  # the session's tiny-sd3 build (a minute or two cold): not in the fast tier
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_counts_equal_the_real_pipeline_load(tiny_sd3_dir: Path, miles_home: Path, dtype: str) -> None:
    """Every component's bytes per dtype as `StableDiffusion3Pipeline.from_pretrained(dtype=...)` loads them (at fp16
    transformers keeps T5's `wo` in fp32: the counts know it)."""
    from diffusers import StableDiffusion3Pipeline

    family = get_family("sd3")
    counts = cache.model_counts(tiny_sd3_dir, family, ("transformer",))
    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_sd3_dir, dtype=torch_dtype(dtype))
    for name, component in counts.components.items():
        assert component.bytes_by_dtype(dtype) == _bytes_by_dtype(getattr(pipe, name)), name
    if dtype == "fp16":
        assert "float32" in counts.components["text_encoder_3"].bytes_by_dtype("fp16")


@pytest.mark.slow  # the session's tiny-sd3 build (a minute or two cold): not in the fast tier
@pytest.mark.parametrize("master", ["fp32", "bf16"])
def test_the_meta_denoiser_is_the_trainers(tiny_sd3_dir: Path, master: str) -> None:
    """`build_denoiser` on meta == `load_denoiser` + `apply_lora` for real: the same names, shapes, dtypes and
    trainable flags (peft puts each adapter in its base weight's dtype)."""
    from miles.training.model import apply_lora

    family = get_family("sd3")
    lora = LoraSpec(4, 8, tuple(family.lora_target_modules))
    real = family.load_denoiser(tiny_sd3_dir, torch_dtype(master))
    args = schema_args(lora_rank=4, lora_alpha=8, lora_target_modules=list(lora.targets), lora_init_weights="gaussian")
    real = apply_lora(real, args, family)
    meta = build_denoiser(tiny_sd3_dir, family, ("transformer",), torch_dtype(master), lora)
    assert _signature(meta) == _signature(real)
    assert _bytes_by_dtype(meta) == _bytes_by_dtype(real)
    assert all(p.device.type == "meta" for p in meta.parameters())


@pytest.mark.slow  # the session's tiny-sd3 build (a minute or two cold): not in the fast tier
def test_a_builtin_name_is_its_built_directory(tiny_sd3_dir: Path) -> None:
    assert config_dir_for("tiny-sd3", get_family("sd3")) == tiny_sd3_dir


def test_fp32_pins_follow_diffusers_keep_in_fp32(tmp_path: Path) -> None:
    """Wan's `_keep_in_fp32_modules` (time_embedder, scale_shift_table, norms) load in fp32 at half precision:
    the meta build gives each tensor the dtype a real `from_pretrained` does."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    tiny = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=4,
        out_channels=4,
        text_dim=16,
        freq_dim=32,
        ffn_dim=16,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    )
    tiny.save_pretrained(tmp_path / "transformer")
    (tmp_path / "model_index.json").write_text(json.dumps({"transformer": ["diffusers", "WanTransformer3DModel"]}))
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        real = WanTransformer3DModel.from_pretrained(tmp_path, subfolder="transformer", dtype=dtype)
        meta = build_component(tmp_path, "transformer", dtype)
        real_dtypes = {n: t.dtype for n, t in [*real.named_parameters(), *real.named_buffers()]}
        meta_dtypes = {n: t.dtype for n, t in [*meta.named_parameters(), *meta.named_buffers()]}
        assert meta_dtypes == real_dtypes, dtype
        if dtype != torch.float32:
            assert torch.float32 in set(real_dtypes.values())


@pytest.mark.slow  # the session's tiny-sd3 build (a minute or two cold): not in the fast tier
def test_static_memory_of_a_local_recipe(tiny_sd3_dir: Path, miles_home: Path) -> None:
    """The tiny recipe on the built tiny-sd3 runs the same estimate; its trainer and engine bytes are the real
    loaded modules' (2 ranks: each holds half of every parameter's rows)."""
    from diffusers import StableDiffusion3Pipeline

    resolved = resolve(None, recipe="tiny-digits-grpo", cli={"hf_checkpoint": str(tiny_sd3_dir)})
    memory = static_memory(resolved)
    args = resolved.args
    assert memory.model.config_dir == str(tiny_sd3_dir)
    forward = torch_dtype(args.diffusion_forward_dtype)
    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_sd3_dir, dtype=forward)
    if forward != torch.float32:
        pipe.vae.to(torch.float32)
    modules = [m for m in pipe.components.values() if isinstance(m, torch.nn.Module)]
    pipeline = sum(sum(_bytes_by_dtype(m).values()) for m in modules)
    engine = next(g for g in memory.gpus if any(s.startswith("engine") for s in g.slots))
    entries = {e.name: e.bytes for e in engine.phases["rollout"] if e.owner.startswith("engine")}
    assert entries["pipeline"] == pipeline
    trainer = next(g for g in memory.gpus if "actor 0" in g.slots)
    train = {e.name: e.bytes for e in trainer.phases["train"] if e.owner == "actor 0"}
    real = get_family("sd3").load_denoiser(tiny_sd3_dir, torch_dtype(args.fsdp_master_dtype))
    world = int(args.actor_num_nodes) * int(args.actor_num_gpus_per_node)
    assert dtype_name(args.fsdp_master_dtype) == "float32" and not args.use_lora
    params = sum(-(-p.shape[0] // world) * (p.numel() // p.shape[0]) * p.element_size() for p in real.parameters())
    assert train["params"] == params and train["grads"] == params and train["adam"] == 2 * params
