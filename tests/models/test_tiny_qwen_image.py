"""The offline tiny-qwen-image checkpoint: its Qwen2 BPE tokenizer, loading, a 2-step true-CFG call,
determinism, metadata, atomicity and a torch-free import."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from miles.models.tiny.metadata import TINY_METADATA_FILE

DIGIT_PROMPT = "a handwritten digit 3"


# ---- tokenizer (no build) ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen_tokenizer():
    from miles.models.qwen_image.tokenizer import build_qwen_tokenizer, qwen_image_prompt_template

    template, drop = qwen_image_prompt_template()
    return build_qwen_tokenizer(template), template, drop


def test_template_prefix_is_exactly_the_dropped_tokens(qwen_tokenizer):
    from miles.models.qwen_image.tokenizer import template_prefix

    tok, template, drop = qwen_tokenizer
    assert drop == 34
    ids = tok(template_prefix(template)).input_ids
    assert len(ids) == drop
    assert tok.convert_ids_to_tokens(ids)[0] == "<|im_start|>" and tok.convert_ids_to_tokens(ids)[-2:] == [
        "user",
        "\u010a",  # byte-level "\n"
    ]
    # the drop cuts exactly at the prompt: the full template's first 34 tokens are the prefix's
    assert tok(template.format(DIGIT_PROMPT)).input_ids[:drop] == ids


def test_digit_prompts_same_length_and_distinct(qwen_tokenizer):
    tok, template, drop = qwen_tokenizer
    three = tok(template.format("a handwritten digit 3")).input_ids[drop:]
    seven = tok(template.format("a handwritten digit 7")).input_ids[drop:]
    assert len(three) == len(seven) == 10  # a, handwritten, digit, " ", 3 + the 5-token template suffix
    assert three != seven
    assert tok.convert_ids_to_tokens(three)[:3] == ["a", "\u0120handwritten", "\u0120digit"]


def test_unseen_text_falls_back_to_bytes(qwen_tokenizer):
    tok, _, _ = qwen_tokenizer
    text = "Zebra xylophone 42! naïve"
    ids = tok(text).input_ids
    assert tok.decode(ids) == text
    assert tok.unk_token_id not in ids  # unk is <|endoftext|>: byte-level BPE never needs it


def test_special_tokens_exist_and_stay_whole(qwen_tokenizer):
    from miles.models.qwen_image.tokenizer import SPECIAL_TOKENS

    tok, _, _ = qwen_tokenizer
    for special in SPECIAL_TOKENS:
        assert tok(special).input_ids == [tok.convert_tokens_to_ids(special)], special
    assert tok.pad_token == tok.eos_token == "<|endoftext|>" and tok.bos_token is None


def test_tokenizer_is_deterministic(qwen_tokenizer):
    from miles.models.qwen_image.tokenizer import build_qwen_tokenizer

    tok, template, _ = qwen_tokenizer
    assert build_qwen_tokenizer(template).get_vocab() == tok.get_vocab()


def test_import_is_torch_free():
    code = (
        "import sys, miles.builtin.tiny.qwen_image, miles.models.qwen_image.tokenizer\nprint('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ---- the build (slow) ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_qwen_dir(tiny_qwen_image_dir):
    """The session's one build (`ensure_checkpoint("tiny-qwen-image")`, seed 0): built once per test session."""
    return tiny_qwen_image_dir


@pytest.fixture(scope="module")
def tiny_qwen_pipeline(tiny_qwen_dir):
    from diffusers import QwenImagePipeline

    from miles.models.loading import quiet_loading

    with quiet_loading():
        pipe = QwenImagePipeline.from_pretrained(tiny_qwen_dir)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.slow
def test_layout_and_metadata(tiny_qwen_dir):
    from miles.models.tiny.metadata import max_sequence_length, read_metadata

    for sub in ("transformer", "vae", "scheduler", "text_encoder", "tokenizer", "digit_classifier"):
        assert (tiny_qwen_dir / sub).is_dir(), sub
    index = json.loads((tiny_qwen_dir / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImagePipeline"
    assert index["text_encoder"] == ["transformers", "Qwen2_5_VLForConditionalGeneration"]
    assert (tiny_qwen_dir / TINY_METADATA_FILE).is_file()
    meta = read_metadata(tiny_qwen_dir)
    assert meta["name"] == "tiny-qwen-image" and meta["resolution"] == 64
    assert meta["sglang_model_id"] == "Qwen-Image"
    assert meta["latent_size"] == 8 and meta["latent_channels"] == 4
    assert max_sequence_length(tiny_qwen_dir) == meta["max_sequence_length"] == 16
    assert meta["tokenizer"]["template_drop"] == 34 and meta["tokenizer"]["digit_prompt_tokens"] == 10
    assert meta["digit_classifier"]["test_accuracy"] >= 0.9
    assert meta["vae"]["test_reconstruction_accuracy"] >= 0.9  # measured 0.989 (seed 0, 150 fit steps)
    assert len(meta["vae"]["latents_mean"]) == len(meta["vae"]["latents_std"]) == 4
    assert set(meta["phase_seconds"]) >= {"tokenizers", "vae fit", "save"}
    assert not list(tiny_qwen_dir.parent.glob(".tiny-qwen-image.tmp-*"))


@pytest.mark.slow
def test_pipeline_two_step_true_cfg(tiny_qwen_dir, tiny_qwen_pipeline):
    import numpy as np
    import torch

    from miles.models.tiny.metadata import max_sequence_length

    pipe = tiny_qwen_pipeline
    msl = max_sequence_length(tiny_qwen_dir)
    out = pipe(
        prompt=DIGIT_PROMPT,
        negative_prompt=" ",
        true_cfg_scale=4.0,
        height=64,
        width=64,
        num_inference_steps=2,
        max_sequence_length=msl,
        output_type="np",
        generator=torch.Generator().manual_seed(0),
    )
    assert out.images.shape == (1, 64, 64, 3)
    assert np.isfinite(out.images).all()
    embeds, mask = pipe.encode_prompt([DIGIT_PROMPT], device="cpu", max_sequence_length=msl)
    assert embeds.shape == (1, 10, 64)
    assert mask is None  # diffusers returns None when the mask is all ones (one unpadded prompt)
    embeds, mask = pipe.encode_prompt(
        [DIGIT_PROMPT, "a handwritten digit seven"], device="cpu", max_sequence_length=msl
    )
    assert embeds.shape == (2, 10, 64) and mask.tolist() == [[1] * 10, [1] * 9 + [0]]


@pytest.mark.slow
def test_vae_latents_are_normalised(tiny_qwen_pipeline):
    import torch

    from miles.builtin.tiny.qwen_image import digits_to_video_input
    from miles.data.digits import load_digits_split

    vae = tiny_qwen_pipeline.vae
    assert tiny_qwen_pipeline.vae_scale_factor == 8
    videos = digits_to_video_input(load_digits_split().test_x[:128])
    with torch.no_grad():
        z = vae.encode(videos).latent_dist.mean
    assert tuple(z.shape) == (128, 4, 1, 8, 8)
    mean = torch.tensor(vae.config.latents_mean).view(1, 4, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, 4, 1, 1, 1)
    normed = (z - mean) / std
    assert normed.mean(dim=(0, 2, 3, 4)).abs().max() < 0.25
    assert ((normed.std(dim=(0, 2, 3, 4)) - 1).abs() < 0.25).all()


def _state(module) -> dict:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].shape == b[k].shape and bool((a[k] == b[k]).all()) for k in a)


@pytest.mark.slow
def test_seeded_weights(tiny_qwen_dir, tiny_qwen_pipeline):
    """The saved transformer/text encoder are their makers' output for seed 0; seed 1 gives other weights."""
    from safetensors.torch import load_file

    from miles.builtin.tiny.qwen_image import make_text_encoder, make_transformer
    from miles.models.qwen_image import tokenizer as qtok

    saved = load_file(tiny_qwen_dir / "transformer" / "diffusion_pytorch_model.safetensors")
    assert _same(saved, _state(make_transformer(0)))
    assert _same(_state(make_transformer(0)), _state(make_transformer(0)))
    assert not _same(_state(make_transformer(0)), _state(make_transformer(1)))
    ids = qtok.token_ids(tiny_qwen_pipeline.tokenizer)
    assert _same(_state(tiny_qwen_pipeline.text_encoder), _state(make_text_encoder(0, ids)))
    assert not _same(_state(make_text_encoder(0, ids)), _state(make_text_encoder(1, ids)))


@pytest.mark.slow
def test_seeded_vae_fit_is_deterministic():
    """Two short fits of the 1-frame video VAE from the same seed give the same weights."""
    from miles.builtin.tiny.qwen_image import digits_to_video_input, make_vae, single_frame_convs
    from miles.builtin.tiny.vae_fit import fit_vae
    from miles.data.digits import load_digits_split

    videos = digits_to_video_input(load_digits_split().train_x[:16])
    states = []
    for _ in range(2):
        vae = make_vae(0)
        with single_frame_convs(vae):
            fit_vae(vae, videos, steps=2, batch_size=4, seed=0)
        states.append(_state(vae))
    assert _same(*states)


@pytest.mark.slow
def test_single_frame_convs_match_the_causal_convs():
    """The fit's 2-D fast path computes what the VAE's own causal 3-D convs compute, and is undone after."""
    import torch

    from miles.builtin.tiny.qwen_image import make_vae, single_frame_convs

    vae = make_vae(0).eval()
    videos = torch.rand(2, 3, 1, 64, 64, generator=torch.Generator().manual_seed(0)) * 2 - 1
    with torch.no_grad():
        ref = vae.decode(vae.encode(videos).latent_dist.mean).sample
        with single_frame_convs(vae):
            fast = vae.decode(vae.encode(videos).latent_dist.mean).sample
        again = vae.decode(vae.encode(videos).latent_dist.mean).sample
    assert torch.allclose(ref, fast, atol=1e-4)
    assert torch.equal(ref, again)
    assert not any("forward" in vars(m) for m in vae.modules())


def test_refuses_non_empty_dir(tmp_path):
    from miles.builtin.tiny.qwen_image import build_tiny_qwen_image

    (tmp_path / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError):
        build_tiny_qwen_image(tmp_path, progress=False)  # refused before anything is built
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]
