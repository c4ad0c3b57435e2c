"""The embedded tiny-sd3 checkpoint: layout, loading, generation, VAE, LoRA targets, ensure_checkpoint."""

from __future__ import annotations

import json

import numpy as np
import pytest

from miles.builtin.checkpoints import ensure_checkpoint
from miles.core.errors import ConfigError
from miles.models.tiny.metadata import METADATA_FILE, default_resolution, max_sequence_length, read_metadata

COMPONENTS = ("transformer", "vae", "scheduler", "text_encoder", "text_encoder_2", "text_encoder_3")
TOKENIZERS = ("tokenizer", "tokenizer_2", "tokenizer_3")


@pytest.mark.slow  # the session's tiny-sd3 build (a minute or two cold): not in the fast tier
def test_layout_and_metadata(tiny_sd3_dir):
    for sub in (*COMPONENTS, *TOKENIZERS, "digit_classifier"):
        assert (tiny_sd3_dir / sub).is_dir(), sub
    index = json.loads((tiny_sd3_dir / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusion3Pipeline"
    assert index["text_encoder_3"] == ["transformers", "T5EncoderModel"]
    meta = read_metadata(tiny_sd3_dir)
    assert meta["name"] == "tiny-sd3" and meta["resolution"] == 64
    assert meta["digit_classifier"]["test_accuracy"] >= 0.97
    assert max_sequence_length(tiny_sd3_dir) == meta["max_sequence_length"] == 8
    assert max_sequence_length("tiny-sd3") == 8  # by name: the session's $MILES_HOME copy
    assert max_sequence_length("stabilityai/stable-diffusion-3.5-medium") == 256
    assert default_resolution(tiny_sd3_dir) == 64 and default_resolution("org/other") is None
    assert not list(tiny_sd3_dir.parent.glob(".tiny-sd3.tmp-*"))


@pytest.mark.slow  # the session's tiny-sd3 build (a minute or two cold): not in the fast tier
def test_sglang_native_constraints(tiny_sd3_pipeline):
    pipe = tiny_sd3_pipeline
    for te in (pipe.text_encoder, pipe.text_encoder_2):
        assert te.config.max_position_embeddings == 77
    assert pipe.tokenizer.model_max_length == pipe.tokenizer_2.model_max_length == 77
    assert type(pipe.text_encoder_3).__name__ == "T5EncoderModel"
    assert pipe.text_encoder_3.config.d_model == pipe.transformer.config.joint_attention_dim
    assert pipe.vae_scale_factor == 8 and len(pipe.vae.config.block_out_channels) == 4
    assert pipe.transformer.config.pooled_projection_dim == (
        pipe.text_encoder.config.projection_dim + pipe.text_encoder_2.config.projection_dim
    )


@pytest.mark.slow  # the session's tiny-sd3 build (a minute or two cold): not in the fast tier
def test_tokenizers_are_offline_and_short(tiny_sd3_pipeline):
    pipe = tiny_sd3_pipeline
    ids = pipe.tokenizer("a handwritten digit 7").input_ids
    assert ids[0] == pipe.tokenizer.bos_token_id and ids[-1] == pipe.tokenizer.eos_token_id
    assert len(ids) == 6  # bos, a, handwritten, digit, 7, eos: whole words
    assert pipe.tokenizer_3("a handwritten digit 7").input_ids[-1] == pipe.tokenizer_3.eos_token_id
    assert len(pipe.tokenizer_3("a handwritten digit 7").input_ids) <= 8
    assert pipe.tokenizer.unk_token_id not in pipe.tokenizer("Zebra xylophone 42!").input_ids[1:-1]


@pytest.mark.slow  # the session's tiny-sd3 build (a minute or two cold): not in the fast tier
def test_pipeline_loads_and_generates(tiny_sd3_dir, monkeypatch):
    import torch
    from diffusers import StableDiffusion3Pipeline

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_sd3_dir)
    pipe.set_progress_bar_config(disable=True)
    prompts = [f"a handwritten digit {k}" for k in range(8)]
    out = pipe(
        prompts,
        num_inference_steps=4,
        guidance_scale=4.0,
        max_sequence_length=max_sequence_length(tiny_sd3_dir),
        generator=torch.Generator().manual_seed(0),
        output_type="pt",
    )
    images = out.images
    assert images.shape == (8, 3, 64, 64)
    assert float(images.std()) > 0.05
    assert float(images.flatten(1).std(dim=1).min()) > 0.02  # no single blank image


@pytest.mark.slow  # the session's tiny-sd3 build (a minute or two cold): not in the fast tier
def test_vae_reconstructs_digits(tiny_sd3_pipeline, digits_split, digit_classifier):
    import torch

    from miles.builtin.tiny.vae_fit import digits_to_vae_input
    from miles.rewards.scorers.digit_metrics import digit_accuracy

    vae = tiny_sd3_pipeline.vae
    x = digits_to_vae_input(digits_split.test_x[:96])
    with torch.no_grad():
        z = vae.encode(x).latent_dist.mean
        normalized = (z - vae.config.shift_factor) * vae.config.scaling_factor
        recon = vae.decode(z).sample
    assert abs(float(normalized.mean())) < 0.25 and 0.75 < float(normalized.std()) < 1.3
    assert float(torch.nn.functional.mse_loss(recon, x)) < 0.01
    assert digit_accuracy(recon.clamp(-1, 1), digits_split.test_y[:96], digit_classifier) >= 0.95


@pytest.mark.slow  # the session's tiny-sd3 build (a minute or two cold): not in the fast tier
def test_sd3_lora_targets_attach(tiny_sd3_pipeline):
    import copy

    from peft import LoraConfig, inject_adapter_in_model
    from peft.tuners.lora import LoraLayer

    from miles.models.families import resolve_family

    family = resolve_family("tiny-sd3", env={})
    transformer = copy.deepcopy(tiny_sd3_pipeline.transformer)
    names = [n for n, _ in transformer.named_modules()]
    for target in family.lora_target_modules:
        assert any(n.endswith("." + target) for n in names), f"no module matches {target}"
    expected = {n for n in names if any(n.endswith("." + t) for t in family.lora_target_modules)}
    model = inject_adapter_in_model(
        LoraConfig(r=4, lora_alpha=8, target_modules=list(family.lora_target_modules)), transformer
    )
    lora_layers = {n for n, m in model.named_modules() if isinstance(m, LoraLayer)}
    assert lora_layers == expected
    # 2 blocks x 8 targets, minus to_add_out in the last (context_pre_only) block
    assert len(lora_layers) == 15
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)


def test_family_classes_resolve_lazily():
    from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline

    from miles.models.families import resolve_family

    family = resolve_family("tiny-sd3", env={})
    assert family.load_pipeline_class() is StableDiffusion3Pipeline
    assert family.load_transformer_class() is SD3Transformer2DModel


@pytest.mark.slow  # the session's tiny-sd3 build (a minute or two cold): not in the fast tier
def test_forward_velocity(tiny_sd3_pipeline):
    import torch

    from miles.models.families import resolve_family

    pipe = tiny_sd3_pipeline
    family = resolve_family("tiny-sd3", env={})
    with torch.no_grad():
        ehs, _, pooled, _ = pipe.encode_prompt(
            "a handwritten digit 3", None, None, do_classifier_free_guidance=False, max_sequence_length=8
        )
        latents = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))
        cond = {"encoder_hidden_states": ehs, "pooled_projections": pooled}
        v = family.forward_velocity(pipe.transformer, latents, torch.tensor([500.0]), cond)
    assert v.shape == latents.shape and ehs.shape == (1, 77 + 8, 64)


@pytest.mark.slow  # the session's tiny-sd3 build (a minute or two cold): not in the fast tier
def test_ensure_checkpoint_passthrough(tiny_sd3_dir, tmp_path):
    assert ensure_checkpoint("tiny-sd3") == tiny_sd3_dir
    assert (
        str(ensure_checkpoint("stabilityai/stable-diffusion-3.5-medium")) == "stabilityai/stable-diffusion-3.5-medium"
    )
    assert ensure_checkpoint(tmp_path) == tmp_path


def _fake_build(calls):
    def build_into(tmp, seed, progress, vae_steps):
        calls.append(seed)
        (tmp / "model_index.json").write_text("{}")
        (tmp / METADATA_FILE).write_text(json.dumps({"name": "tiny-sd3", "max_sequence_length": 8, "resolution": 64}))
        from miles.builtin.tiny.build import BuildReport

        return BuildReport(out_dir=tmp, seconds=0.0)

    return build_into


def test_ensure_checkpoint_is_atomic_and_cached(miles_home, monkeypatch):
    from miles.builtin.tiny import sd3 as builder

    def interrupted(tmp, seed, progress, vae_steps):
        (tmp / "model_index.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(builder.TinySD3Build, "build_into", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ensure_checkpoint("tiny-sd3")
    models = miles_home / "models"
    assert not (models / "tiny-sd3").exists()
    assert not list(models.glob(".tiny-sd3.tmp-*"))

    calls: list[int] = []
    monkeypatch.setattr(builder.TinySD3Build, "build_into", _fake_build(calls))
    path = ensure_checkpoint("tiny-sd3")
    assert path == models / "tiny-sd3" and (path / METADATA_FILE).is_file()
    assert ensure_checkpoint("tiny-sd3") == path
    assert calls == [0]  # built once, reused after


def test_ensure_checkpoint_rejects_a_partial_dir(miles_home):
    (miles_home / "models" / "tiny-sd3").mkdir(parents=True)
    (miles_home / "models" / "tiny-sd3" / "junk").write_text("x")
    with pytest.raises(ConfigError, match="not a complete tiny-sd3 checkpoint"):
        ensure_checkpoint("tiny-sd3")


@pytest.mark.slow  # the session's tiny-sd3 build (a minute or two cold): not in the fast tier
def test_models_cli(tiny_sd3_dir, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from miles.builtin.tiny import sd3 as builder
    from miles_cli.models_cmd import app

    runner = CliRunner()
    res = runner.invoke(app, ["build", "tiny-sd3"])
    assert res.exit_code == 0 and "already built" in res.output and "0.99" in res.output

    res = runner.invoke(app, ["build", "sdxl"])
    assert isinstance(res.exception, ConfigError) and "buildable models: tiny-sd3" in str(res.exception)

    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "f").write_text("x")
    res = runner.invoke(app, ["build", "tiny-sd3", "--out", str(busy)])
    assert isinstance(res.exception, ConfigError) and "--out" in str(res.exception)

    calls: list[int] = []
    monkeypatch.setattr(builder.TinySD3Build, "build_into", _fake_build(calls))
    res = runner.invoke(app, ["build", "tiny-sd3", "--out", str(tmp_path / "new"), "--seed", "3"])
    assert res.exit_code == 0, res.output
    assert calls == [3] and "built tiny-sd3" in res.output and "classifier test accuracy" in res.output
    assert (tmp_path / "new" / METADATA_FILE).is_file()


@pytest.mark.slow  # the session's tiny-sd3 build (a minute or two cold): not in the fast tier
def test_classifier_accuracy_recomputed(tiny_sd3_dir, digit_classifier, digits_split):
    from miles.rewards.scorers.digit import digits_to_features, read_classifier_metadata

    pred = digit_classifier.predict(digits_to_features(digits_split.test_x))
    acc = float(np.mean(pred == digits_split.test_y))
    assert acc >= 0.97
    assert read_classifier_metadata(tiny_sd3_dir)["test_accuracy"] == pytest.approx(acc)
