"""The offline tiny-flux checkpoint: layout, metadata, loading, generation, seeding, atomic builds.

A module fixture builds tiny-flux with a short VAE fit (every test but the slow one only needs a
working VAE, not a fitted one); the slow test takes the session's default build (conftest's
`tiny_flux_dir`, shared with the other tests of the family) and checks the fitted VAE, and that
everything the VAE fit does not touch is byte-identical across the two builds of seed 0.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import numpy as np
import pytest

from miles.models.tiny.metadata import TINY_METADATA_FILE, default_resolution, max_sequence_length, read_metadata

FAST_VAE_STEPS = 10
COMPONENTS = ("transformer", "vae", "scheduler", "text_encoder", "text_encoder_2")
TOKENIZERS = ("tokenizer", "tokenizer_2")
METADATA_KEYS = {
    "name",
    "format_version",
    "seed",
    "resolution",
    "latent_size",
    "latent_channels",
    "max_sequence_length",
    "clip_max_length",
    "prompt_template",
    "data",
    "sglang_model_id",
    "vae",
    "digit_classifier",
    "params",
    "build_seconds",
    "phase_seconds",
    "versions",
}
VAE_KEYS = {
    "shift_factor",
    "scaling_factor",
    "fit_steps",
    "batch_size",
    "lr",
    "test_mse",
    "test_reconstruction_accuracy",
}
PROMPT = "a handwritten digit 3"


def _files(root) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _state_hash(state: dict) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(state.items()):
        h.update(name.encode())
        h.update(tensor.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def fast_flux_build(tmp_path_factory):
    from miles.builtin.tiny.flux import build_tiny_flux

    return build_tiny_flux(
        tmp_path_factory.mktemp("flux") / "tiny-flux", seed=0, progress=False, vae_steps=FAST_VAE_STEPS
    )


@pytest.fixture(scope="module")
def fast_flux_dir(fast_flux_build):
    return fast_flux_build.out_dir


@pytest.fixture(scope="module")
def fast_flux_pipeline(fast_flux_dir):
    from diffusers import FluxPipeline

    from miles.models.loading import quiet_loading

    with quiet_loading():
        pipe = FluxPipeline.from_pretrained(fast_flux_dir)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_module_imports_without_torch():
    code = "import sys, miles.builtin.tiny.flux; assert 'torch' not in sys.modules, 'torch imported'"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


@pytest.mark.slow  # over a second (a build, a video set, a spawned process)
def test_layout_and_metadata(fast_flux_build, fast_flux_dir):
    for sub in (*COMPONENTS, *TOKENIZERS, "digit_classifier"):
        assert (fast_flux_dir / sub).is_dir(), sub
    index = json.loads((fast_flux_dir / "model_index.json").read_text())
    assert index["_class_name"] == "FluxPipeline"
    assert index["text_encoder"] == ["transformers", "CLIPTextModel"]
    assert index["text_encoder_2"] == ["transformers", "T5EncoderModel"]
    assert index["transformer"] == ["diffusers", "FluxTransformer2DModel"]
    assert (fast_flux_dir / TINY_METADATA_FILE).is_file() and not (fast_flux_dir / "miles_tiny_sd3.json").exists()

    meta = read_metadata(fast_flux_dir)
    assert set(meta) == METADATA_KEYS and set(meta["vae"]) == VAE_KEYS
    assert meta["name"] == "tiny-flux" and meta["seed"] == 0
    assert meta["resolution"] == 64 and meta["latent_size"] == 8 and meta["latent_channels"] == 4
    assert meta["max_sequence_length"] == 8 and meta["clip_max_length"] == 77
    assert meta["sglang_model_id"] == "FLUX.1-dev"
    assert meta["vae"]["fit_steps"] == FAST_VAE_STEPS
    assert meta["digit_classifier"]["path"] == "digit_classifier"
    assert meta["digit_classifier"]["test_accuracy"] >= 0.97  # tiny-sd3's bar; the classifier fit is shared
    assert set(meta["params"]) == {"transformer", "vae", "text_encoder", "text_encoder_2"}
    assert meta["params"] == fast_flux_build.params
    assert set(meta["phase_seconds"]) == {
        "tokenizers",
        "text encoders",
        "transformer",
        "data",
        "vae fit",
        "vae stats",
        "classifier",
        "save",
    }
    assert max_sequence_length(fast_flux_dir) == 8 and default_resolution(fast_flux_dir) == 64
    assert not list(fast_flux_dir.parent.glob(".tiny-flux.tmp-*"))


@pytest.mark.slow  # the module's tiny-flux build (10 VAE steps, ~20 s): not in the fast tier
def test_component_configs(fast_flux_pipeline):
    pipe = fast_flux_pipeline
    assert type(pipe.text_encoder).__name__ == "CLIPTextModel"
    assert pipe.text_encoder.config.max_position_embeddings == 77 == pipe.tokenizer.model_max_length
    cfg = pipe.transformer.config
    assert cfg.in_channels == 4 * pipe.vae.config.latent_channels and cfg.patch_size == 1
    assert sum(cfg.axes_dims_rope) == cfg.attention_head_dim and cfg.guidance_embeds
    assert cfg.pooled_projection_dim == pipe.text_encoder.config.hidden_size
    assert cfg.joint_attention_dim == pipe.text_encoder_2.config.d_model
    assert pipe.vae_scale_factor == 8
    sched = pipe.scheduler.config
    assert sched.use_dynamic_shifting and sched.time_shift_type == "exponential"
    assert (sched.base_shift, sched.max_shift, sched.base_image_seq_len, sched.max_image_seq_len) == (
        0.5,
        1.15,
        256,
        4096,
    )
    t5_ids = pipe.tokenizer_2(PROMPT).input_ids
    assert len(t5_ids) <= 8 and t5_ids[-1] == pipe.tokenizer_2.eos_token_id


@pytest.mark.slow  # the module's tiny-flux build (10 VAE steps, ~20 s): not in the fast tier
def test_encode_prompt_shapes(fast_flux_pipeline):
    import torch

    with torch.no_grad():
        prompt_embeds, pooled, text_ids = fast_flux_pipeline.encode_prompt(
            [PROMPT, "the number seven"], None, max_sequence_length=8
        )
    assert prompt_embeds.shape == (2, 8, 64)
    assert pooled.shape == (2, 32)
    assert text_ids.shape == (8, 3)


@pytest.mark.slow  # the module's tiny-flux build (10 VAE steps, ~20 s): not in the fast tier
def test_pipeline_generates(fast_flux_pipeline):
    import torch

    out = fast_flux_pipeline(
        prompt=PROMPT,
        height=64,
        width=64,
        num_inference_steps=2,
        guidance_scale=3.5,
        max_sequence_length=8,
        output_type="np",
        generator=torch.Generator().manual_seed(0),
    )
    assert out.images.shape == (1, 64, 64, 3)
    assert np.isfinite(out.images).all()


@pytest.mark.slow  # the module's tiny-flux build (10 VAE steps, ~20 s): not in the fast tier
def test_components_are_the_seeded_inits(fast_flux_dir):
    from safetensors.torch import load_file

    from miles.builtin.tiny import flux as tiny

    saved = load_file(fast_flux_dir / "transformer" / "diffusion_pytorch_model.safetensors")
    assert _state_hash(saved) == _state_hash(tiny.make_transformer(0).state_dict())
    assert _state_hash(saved) != _state_hash(tiny.make_transformer(1).state_dict())
    # each component has its own seed: the CLIP init does not depend on the transformer's, or vice versa
    tok = {"clip_vocab_size": 638, "clip_bos_id": 636, "clip_eos_id": 637, "clip_pad_id": 637}
    te = _state_hash(tiny.make_clip_text_encoder(0, tok).state_dict())
    assert te == _state_hash(tiny.make_clip_text_encoder(0, tok).state_dict())
    assert te != _state_hash(tiny.make_clip_text_encoder(1, tok).state_dict())


def test_build_refuses_a_non_empty_dir(tmp_path):
    from miles.builtin.tiny.flux import build_tiny_flux

    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "f").write_text("x")
    with pytest.raises(FileExistsError):
        build_tiny_flux(tmp_path / "busy", progress=False)
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError):
        build_tiny_flux(tmp_path / "file", progress=False)


def test_interrupted_build_leaves_nothing(tmp_path, monkeypatch):
    from miles.builtin.tiny import flux as tiny

    def interrupted(tmp, seed, progress, vae_steps):
        (tmp / "model_index.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(tiny.TinyFluxBuild, "build_into", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tiny.build_tiny_flux(tmp_path / "tiny-flux", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_ensure_checkpoint_builds_tiny_flux(miles_home, monkeypatch):
    from miles.builtin.checkpoints import ensure_checkpoint
    from miles.builtin.tiny import flux as tiny

    calls: list[int] = []

    def fake(tmp, seed, progress, vae_steps):
        calls.append(seed)
        (tmp / "model_index.json").write_text("{}")
        (tmp / TINY_METADATA_FILE).write_text(json.dumps({"name": "tiny-flux", "max_sequence_length": 8}))
        return tiny.BuildReport(out_dir=tmp, seconds=0.0)

    monkeypatch.setattr(tiny.TinyFluxBuild, "build_into", fake)
    path = ensure_checkpoint("tiny-flux", progress=False)
    assert path == miles_home / "models" / "tiny-flux" and (path / TINY_METADATA_FILE).is_file()
    assert ensure_checkpoint("tiny-flux") == path and calls == [0]


@pytest.mark.slow  # the session's default build (ensure_checkpoint): ~30 s on 2 idle cores, unless built already
def test_default_build_fits_the_vae_and_is_deterministic(tiny_flux_dir, fast_flux_dir, miles_session_home):
    import torch
    from diffusers import AutoencoderKL

    from miles.builtin.tiny.vae_fit import VAE_STEPS, digits_to_vae_input
    from miles.data.digits import load_digits_split
    from miles.rewards.scorers.digit import read_classifier_metadata

    assert tiny_flux_dir == miles_session_home / "models" / "tiny-flux"
    meta = read_metadata(tiny_flux_dir)
    assert meta["name"] == "tiny-flux" and meta["seed"] == 0
    assert meta["vae"]["fit_steps"] == VAE_STEPS
    assert meta["vae"]["test_mse"] < 0.01
    assert meta["vae"]["test_reconstruction_accuracy"] >= 0.95  # tiny-sd3's bar
    assert meta["digit_classifier"]["test_accuracy"] >= 0.97
    clf_meta = read_classifier_metadata(tiny_flux_dir)
    assert clf_meta["vae_reconstruction_accuracy"] == meta["vae"]["test_reconstruction_accuracy"]

    vae = AutoencoderKL.from_pretrained(tiny_flux_dir / "vae")
    x = digits_to_vae_input(load_digits_split().test_x[:64])
    with torch.no_grad():
        z = vae.encode(x).latent_dist.mean
    normalized = (z - vae.config.shift_factor) * vae.config.scaling_factor
    assert abs(float(normalized.mean())) < 0.25 and 0.75 < float(normalized.std()) < 1.3

    # same seed, another VAE step count: everything the VAE fit does not touch is byte-identical
    ours, theirs = _files(tiny_flux_dir), _files(fast_flux_dir)
    assert ours.keys() == theirs.keys()
    fit_dependent = {TINY_METADATA_FILE, "digit_classifier/classifier.json"}
    same = [k for k in ours if k not in fit_dependent and not k.startswith("vae/")]
    assert "transformer/diffusion_pytorch_model.safetensors" in same
    different = [k for k in same if ours[k] != theirs[k]]
    assert not different, different
