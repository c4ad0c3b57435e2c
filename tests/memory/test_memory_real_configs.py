"""The real-size configs miles ships: one folder per shipped GPU recipe's checkpoint, their published sizes, and
their `counts.json` equal to a fresh meta-device measurement (so `miles plan` can trust them without torch)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from miles.memory.cache import cached_counts
from miles.memory.config_dirs import COUNTS_FILE, config_files, config_hash
from miles.memory.shipped import shipped_models, shipped_recipes

ROOT = Path(__file__).resolve().parents[2]
GPU_RECIPES = {
    "cosmos3-pickscore-t2i": "nvidia/Cosmos3-Nano",
    "flux-kontext-edit-grpo": "black-forest-labs/FLUX.1-Kontext-dev",
    "flux-pickscore-grpo": "black-forest-labs/FLUX.1-dev",
    "flux2-klein-pickscore-grpo": "black-forest-labs/FLUX.2-klein-base-4B",
    "ltx23-pickscore-grpo": "Lightricks/LTX-2",
    "qwen-image-edit-grpo": "Qwen/Qwen-Image-Edit-2511",
    "qwen-image-pickscore-grpo": "Qwen/Qwen-Image",
    "sd3-ocr-grpo": "stabilityai/stable-diffusion-3.5-medium",
    "sd3-pickscore-nft": "stabilityai/stable-diffusion-3.5-medium",
    "sd35-4step": "stabilityai/stable-diffusion-3.5-medium",
    "wan22-i2v-grpo": "Wan-AI/Wan2.2-I2V-A14B-Diffusers",
    "wan22-lora-sft": "Wan-AI/Wan2.2-T2V-A14B-Diffusers",
    "wan22-pickscore-grpo": "Wan-AI/Wan2.2-T2V-A14B-Diffusers",
    "z-image-pickscore-grpo": "Tongyi-MAI/Z-Image-Turbo",
}
# parameters per component, as built on meta from the shipped configs, against published sizes (SOURCES.md)
PUBLISHED = {
    "stable-diffusion-3.5-medium": {
        "transformer": 2_243_171_520,  # shared/reference/memory_estimation.md's MMDiT
        "text_encoder": 123_650_304,
        "text_encoder_2": 694_659_840,
        "text_encoder_3": 4_762_310_656,
        "vae": 83_819_683,
    },
    "FLUX.1-dev": {
        "transformer": 11_901_408_320,
        "text_encoder": 123_060_480,
        "text_encoder_2": 4_762_310_656,
        "vae": 83_819_683,
    },
    "FLUX.1-Kontext-dev": {  # FLUX.1-dev's architecture (its SOURCES.md): BFL's "12 billion parameter"
        "transformer": 11_901_408_320,
        "text_encoder": 123_060_480,
        "text_encoder_2": 4_762_310_656,
        "vae": 83_819_683,
    },
    # klein's "4B" transformer, Qwen3-4B (tied embeddings, counted once), FLUX.2's VAE (its SOURCES.md)
    "FLUX.2-klein-base-4B": {"transformer": 3_875_544_576, "text_encoder": 4_022_468_096, "vae": 84_046_115},
    # the "6B" single-stream DiT, Qwen3-4B as a Qwen3Model, FLUX.1's VAE (its SOURCES.md)
    "Z-Image-Turbo": {"transformer": 6_154_908_736, "text_encoder": 4_022_468_096, "vae": 83_819_683},
    "Qwen-Image": {"transformer": 20_430_401_088, "text_encoder": 8_292_166_656, "vae": 126_892_531},
    "Qwen-Image-Edit-2511": {"transformer": 20_430_401_088, "text_encoder": 8_292_166_656, "vae": 126_892_531},
    "Wan2.2-T2V-A14B-Diffusers": {
        "transformer": 14_288_491_584,
        "transformer_2": 14_288_491_584,
        "text_encoder": 5_680_910_336,
        "vae": 126_892_531,
    },
    "Wan2.2-I2V-A14B-Diffusers": {  # T2V's experts with 36 input channels (its SOURCES.md)
        "transformer": 14_288_901_184,
        "transformer_2": 14_288_901_184,
        "text_encoder": 5_680_910_336,
        "vae": 126_892_531,
    },
    "Wan2.2-TI2V-5B-Diffusers": {  # one 5B transformer (48 in/out channels), the Wan2.2 VAE (its SOURCES.md)
        "transformer": 4_999_787_712,
        "text_encoder": 5_680_910_336,
        "vae": 704_688_668,
    },
    "Cosmos3-Nano": {"transformer": 15_173_669_120, "vae": 704_688_668},
    "LTX-2": {
        "transformer": 18_876_174_592,
        "connectors": 1_431_475_200,
        "text_encoder": 12_187_325_040,
        "vae": 1_222_479_601,
        "audio_vae": 53_248_146,
        "vocoder": 55_592_802,
    },
}
MODELS = sorted(shipped_models().items(), key=lambda kv: kv[0].name)


def test_every_shipped_gpu_recipe_has_real_configs() -> None:
    found = {name: resolved.args.hf_checkpoint for name, resolved, _ in shipped_recipes()}
    assert found == GPU_RECIPES
    for name, _, config_dir in shipped_recipes():
        assert config_dir.name == GPU_RECIPES[name].rpartition("/")[2]
        assert (config_dir / "SOURCES.md").is_file()


@pytest.mark.parametrize("config_dir", [d for d, _ in MODELS], ids=[d.name for d, _ in MODELS])
def test_shipped_counts_are_current_and_published_sizes(config_dir: Path) -> None:
    counts = cached_counts(config_dir)
    assert counts is not None, f"{config_dir / COUNTS_FILE} is stale: run python -m miles.memory.shipped"
    assert {n: c.parameters for n, c in counts.components.items()} == PUBLISHED[config_dir.name]


@pytest.mark.slow  # builds real-size models on meta: seconds each
@pytest.mark.parametrize("config_dir,model", MODELS, ids=[d.name for d, _ in MODELS])
def test_shipped_counts_equal_a_fresh_meta_build(config_dir: Path, model) -> None:
    from miles.memory.measure import measure

    fresh = measure(config_dir, model.family, model.components, model.targets).to_json()
    shipped = cached_counts(config_dir).to_json()
    # the same tensors with today's libraries (the record's versions say which it was measured with)
    assert {k: v for k, v in fresh.items() if k != "versions"} == {k: v for k, v in shipped.items() if k != "versions"}


def test_the_configs_ship_in_the_wheel() -> None:
    """hatch packages every file under miles/ that git does not ignore: none of the config files is ignored."""
    files = [str(p.relative_to(ROOT)) for d, _ in MODELS for p in [*config_files(d), d / COUNTS_FILE]]
    ignored = subprocess.run(["git", "check-ignore", *files], cwd=ROOT, capture_output=True, text=True)
    assert ignored.stdout == ""
    assert 'packages = ["miles", "miles_cli"]' in (ROOT / "pyproject.toml").read_text()


def test_config_hash_covers_the_configs(tmp_path: Path) -> None:
    import shutil

    source = next(d for d, _ in MODELS if d.name == "FLUX.1-dev")
    copy = tmp_path / "FLUX.1-dev"
    shutil.copytree(source, copy)
    assert config_hash(copy) == config_hash(source)
    (copy / "SOURCES.md").write_text("prose does not change sizes")
    assert config_hash(copy) == config_hash(source)
    config = copy / "transformer" / "config.json"
    config.write_text(config.read_text().replace('"num_single_layers": 38', '"num_single_layers": 37'))
    assert config_hash(copy) != config_hash(source)
    assert cached_counts(copy) is None  # a changed config is measured again, never served stale counts


def test_a_module_that_cannot_be_imported_is_named_not_silently_dropped(tmp_path: Path, miles_home: Path) -> None:
    import json
    import shutil

    from miles.memory.cache import model_counts
    from miles.models.families import get_family

    copy = tmp_path / "Cosmos3-Nano"
    shutil.copytree(next(d for d, _ in MODELS if d.name == "Cosmos3-Nano"), copy)
    index = json.loads((copy / "model_index.json").read_text())
    index["safety_checker"] = ["cosmos_guardrail", "CosmosSafetyChecker"]
    (copy / "model_index.json").write_text(json.dumps(index))
    counts = model_counts(copy, get_family("cosmos3"), ("transformer",))
    assert counts.unresolved == ("safety_checker (cosmos_guardrail.CosmosSafetyChecker)",)
    assert sorted(counts.components) == ["transformer", "vae"]
