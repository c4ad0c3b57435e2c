"""The offline tiny-wan2_2 checkpoint: loading with both experts and the boundary, a 2-step CFG call over
9 frames, metadata, the VAE's reconstruction scores and latent statistics, seeded experts, atomicity and a
torch-free import."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from miles.models.tiny.metadata import TINY_METADATA_FILE

PROMPT = "the digit 3 moving right"
FRAME_ACCURACY_MIN = 0.95
DIRECTION_ACCURACY_MIN = 0.95


def test_import_is_torch_free():
    code = "import sys, miles.builtin.tiny.wan2_2; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_registered():
    from miles.builtin.checkpoints import TINY_BUILDERS, tiny_builder
    from miles.builtin.tiny.wan2_2 import build_tiny_wan2_2

    assert TINY_BUILDERS["tiny-wan2_2"] == "miles.builtin.tiny.wan2_2:build_tiny_wan2_2"
    assert tiny_builder("tiny-wan2_2") is build_tiny_wan2_2


def test_tokenizer_knows_the_video_prompts():
    from miles.builtin.tiny.wan2_2 import TINY_WAN_MAX_SEQUENCE_LENGTH, make_tokenizer
    from miles.models.tiny.tokenizers import build_t5_tokenizer

    tok = make_tokenizer()
    ids = tok(PROMPT).input_ids
    assert len(ids) == 6 and ids[-1] == tok.eos_token_id  # the, digit, 3, moving, right, </s>
    assert tok.unk_token_id not in ids
    assert len(ids) <= TINY_WAN_MAX_SEQUENCE_LENGTH
    assert tok(PROMPT.replace("right", "left")).input_ids != ids
    assert make_tokenizer().get_vocab() == tok.get_vocab()  # deterministic
    assert build_t5_tokenizer().get_vocab() != tok.get_vocab()  # tiny-sd3's own vocab is untouched


def test_refuses_non_empty_dir(tmp_path):
    from miles.builtin.tiny.wan2_2 import build_tiny_wan2_2

    (tmp_path / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError):
        build_tiny_wan2_2(tmp_path, progress=False)  # refused before anything is built
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


# ---- the build (slow) ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_wan_pipeline(tiny_wan2_2_dir):
    from diffusers import WanPipeline

    from miles.models.loading import quiet_loading

    with quiet_loading():
        pipe = WanPipeline.from_pretrained(tiny_wan2_2_dir)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.slow
def test_layout_and_metadata(tiny_wan2_2_dir):
    from miles.models.tiny.metadata import default_resolution, max_sequence_length, read_metadata

    for sub in ("transformer", "transformer_2", "vae", "scheduler", "text_encoder", "tokenizer", "digit_classifier"):
        assert (tiny_wan2_2_dir / sub).is_dir(), sub
    index = json.loads((tiny_wan2_2_dir / "model_index.json").read_text())
    assert index["_class_name"] == "WanPipeline"
    assert index["boundary_ratio"] == 0.875
    assert index["text_encoder"] == ["transformers", "UMT5EncoderModel"]
    assert index["transformer"] == index["transformer_2"] == ["diffusers", "WanTransformer3DModel"]
    assert index["scheduler"] == ["diffusers", "UniPCMultistepScheduler"]
    assert (tiny_wan2_2_dir / TINY_METADATA_FILE).is_file()
    meta = read_metadata(tiny_wan2_2_dir)
    for key in (
        "name",
        "format_version",
        "seed",
        "resolution",
        "num_frames",
        "fps",
        "latent_size",
        "latent_frames",
        "latent_channels",
        "max_sequence_length",
        "boundary_ratio",
        "prompt_template",
        "data",
        "sglang_model_id",
        "vae",
        "digit_classifier",
        "params",
        "build_seconds",
        "phase_seconds",
        "versions",
    ):
        assert key in meta, key
    assert meta["name"] == "tiny-wan2_2" and meta["seed"] == 0
    assert meta["design"] == 2  # an older cached design is rebuilt on first use (tests/models/test_teacher_stamp.py)
    assert meta["num_frames"] == 9 and meta["fps"] == 8 and meta["resolution"] == default_resolution(tiny_wan2_2_dir)
    assert max_sequence_length(tiny_wan2_2_dir) == meta["max_sequence_length"] == 16
    assert meta["sglang_model_id"] == "Wan2.2-T2V-A14B-Diffusers"
    assert meta["digit_classifier"]["input"] == "video" and meta["digit_classifier"]["test_accuracy"] >= 0.95
    assert set(meta["params"]) == {"transformer", "transformer_2", "vae", "text_encoder"}
    assert meta["params"]["transformer"] == meta["params"]["transformer_2"]
    from miles.models.digit_classifier import read_classifier_metadata

    assert read_classifier_metadata(tiny_wan2_2_dir)["input"] == "video"
    assert not list(tiny_wan2_2_dir.parent.glob(".tiny-wan2_2.tmp-*"))


@pytest.mark.extended  # the full build (its VAE fit: minutes); the session fixture fits 40 steps only
def test_reconstruction_scores_stored_and_good():
    from miles.builtin.checkpoints import ensure_checkpoint
    from miles.models.tiny.metadata import read_metadata

    path = ensure_checkpoint("tiny-wan2_2", progress=False)
    vae = read_metadata(path)["vae"]
    assert vae["test_reconstruction_accuracy"] >= FRAME_ACCURACY_MIN  # per decoded frame
    assert vae["test_direction_accuracy"] >= DIRECTION_ACCURACY_MIN
    assert vae["temporal_compression"] == 1 and vae["spatial_compression"] == 4
    assert len(vae["latents_mean"]) == len(vae["latents_std"]) == read_metadata(path)["latent_channels"]


@pytest.mark.slow
def test_components_and_config(tiny_wan_pipeline, tiny_wan2_2_dir):
    from miles.models.tiny.metadata import read_metadata

    pipe = tiny_wan_pipeline
    meta = read_metadata(tiny_wan2_2_dir)
    assert type(pipe).__name__ == "WanPipeline"
    assert pipe.config.boundary_ratio == 0.875
    assert pipe.transformer is not None and pipe.transformer_2 is not None
    assert type(pipe.text_encoder).__name__ == "UMT5EncoderModel"
    assert pipe.text_encoder.config.d_model == pipe.transformer.config.text_dim
    side = meta["latent_size"]
    for expert in (pipe.transformer, pipe.transformer_2):
        # one token per latent frame (Wan's DiT has no absolute position signal between patches), and an
        # expert wide enough to carry a whole patch (cells x channels) through
        assert tuple(expert.config.patch_size) == (1, side, side)
        assert expert.config.in_channels == expert.config.out_channels == pipe.vae.config.z_dim
        width = expert.config.num_attention_heads * expert.config.attention_head_dim
        assert width >= side * side * pipe.vae.config.z_dim
    sched = pipe.scheduler.config
    assert type(pipe.scheduler).__name__ == "UniPCMultistepScheduler"
    assert sched.prediction_type == "flow_prediction" and sched.use_flow_sigmas and sched.flow_shift == 12.0
    assert sched.num_train_timesteps == 1000
    assert pipe.vae_scale_factor_spatial == meta["vae"]["spatial_compression"] == 4
    assert pipe.vae_scale_factor_temporal == meta["vae"]["temporal_compression"]
    assert (meta["num_frames"] - 1) // pipe.vae_scale_factor_temporal + 1 == meta["latent_frames"]


@pytest.mark.slow
def test_experts_differ(tiny_wan_pipeline):
    a, b = tiny_wan_pipeline.transformer.state_dict(), tiny_wan_pipeline.transformer_2.state_dict()
    assert a.keys() == b.keys()
    assert all(a[k].shape == b[k].shape for k in a)
    assert any(not bool((a[k] == b[k]).all()) for k in a if a[k].numel() > 1 and a[k].std() > 0)


@pytest.mark.slow
def test_pipeline_two_step_cfg(tiny_wan2_2_dir, tiny_wan_pipeline):
    import torch

    from miles.models.tiny.metadata import max_sequence_length, read_metadata

    meta = read_metadata(tiny_wan2_2_dir)
    pipe = tiny_wan_pipeline
    seen = []
    hooks = [
        expert.register_forward_pre_hook(lambda m, args, name=name: seen.append(name))
        for name, expert in (("transformer", pipe.transformer), ("transformer_2", pipe.transformer_2))
    ]
    try:
        out = pipe(
            prompt=PROMPT,
            negative_prompt=" ",
            guidance_scale=4.0,
            guidance_scale_2=3.0,
            # WanPipeline makes F // factor * factor + 1 frames when F % factor != 1: 8 gives 9 at factor 1
            num_frames=8 if pipe.vae_scale_factor_temporal == 1 else 9,
            height=64,
            width=64,
            num_inference_steps=2,
            max_sequence_length=max_sequence_length(tiny_wan2_2_dir),
            output_type="latent",
            generator=torch.Generator().manual_seed(0),
        )
    finally:
        for hook in hooks:
            hook.remove()
    latents = out.frames
    c, f, s = meta["latent_channels"], meta["latent_frames"], meta["latent_size"]
    assert tuple(latents.shape) == (1, c, f, s, s)
    assert torch.isfinite(latents).all()
    # each step runs its expert twice (CFG: conditional, unconditional); at shift 12 both of 2 steps are high
    # noise (sigmas 1 and 12*0.5 / (1 + 11*0.5) = 0.923: t = 1000, 923 >= 875)
    timesteps = [float(t) for t in pipe.scheduler.timesteps]
    expected = ["transformer" if t >= 875 else "transformer_2" for t in timesteps for _ in range(2)]
    assert len(timesteps) == 2 and seen == expected == ["transformer"] * 4
    embeds, _ = pipe.encode_prompt(PROMPT, do_classifier_free_guidance=False, max_sequence_length=16)
    assert tuple(embeds.shape) == (1, 16, pipe.text_encoder.config.d_model)
    assert embeds[0, 6:].abs().sum() == 0  # WanPipeline zero-pads the UMT5 states past the prompt's 6 tokens


@pytest.mark.slow
def test_vae_latents_are_normalised(tiny_wan_pipeline):
    import torch

    from miles.builtin.tiny.vae_fit import digit_videos_to_vae_input
    from miles.data.digits import load_digits_split

    vae = tiny_wan_pipeline.vae
    videos, _ = digit_videos_to_vae_input(load_digits_split().test_x[:64])
    with torch.no_grad():
        z = vae.encode(videos).latent_dist.mean
    c = vae.config.z_dim
    assert z.shape[0] == 64 and z.shape[1] == c and tuple(z.shape[2:]) == (9, 16, 16)
    mean = torch.tensor(vae.config.latents_mean).view(1, c, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, c, 1, 1, 1)
    normed = (z - mean) / std
    assert normed.mean(dim=(0, 2, 3, 4)).abs().max() < 0.3
    assert ((normed.std(dim=(0, 2, 3, 4)) - 1).abs() < 0.3).all()


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].shape == b[k].shape and bool((a[k] == b[k]).all()) for k in a)


@pytest.mark.slow
def test_seeded_weights(tiny_wan2_2_dir, tiny_wan_pipeline):
    """The saved experts and text encoder are their makers' output for seed 0 (a rebuild gives the same tensors);
    another seed, or the other expert's offset, gives other weights. Cheap: no VAE fit."""
    from safetensors.torch import load_file

    from miles.builtin.tiny.wan2_2 import make_text_encoder, make_tokenizer, make_transformer

    def state(module) -> dict:
        return {k: v.detach().clone() for k, v in module.state_dict().items()}

    for name in ("transformer", "transformer_2"):
        saved = load_file(tiny_wan2_2_dir / name / "diffusion_pytorch_model.safetensors")
        assert _same(saved, state(make_transformer(0, name))), name
    assert not _same(state(make_transformer(0, "transformer")), state(make_transformer(1, "transformer")))
    tok = make_tokenizer()
    assert _same(state(tiny_wan_pipeline.text_encoder), state(make_text_encoder(0, tok)))
    assert not _same(state(make_text_encoder(0, tok)), state(make_text_encoder(1, tok)))


@pytest.mark.slow
def test_seeded_vae_fit_is_deterministic():
    """Two short fits of the video VAE from the same seed give the same weights."""
    from miles.builtin.tiny.vae_fit import digit_videos_to_vae_input, fit_vae
    from miles.builtin.tiny.wan2_2 import make_vae
    from miles.data.digits import load_digits_split

    videos, _ = digit_videos_to_vae_input(load_digits_split().train_x[:8])
    states = []
    for _ in range(2):
        vae = make_vae(0)
        fit_vae(vae, videos, steps=2, batch_size=2, seed=0)
        states.append({k: v.detach().clone() for k, v in vae.state_dict().items()})
    assert _same(*states)
