"""Built-in rewards (JPEG, OCR, PickScore, digit) and their dispatch (`batched_async_rm`).

Everything runs offline: OCR uses the models inside the rapidocr_onnxruntime wheel, PickScore a tiny
random CLIP built here, the digit reward a classifier fitted here (about 1 s).
"""

from __future__ import annotations

import asyncio
import math
import textwrap
import time

import numpy as np
import pytest
import torch

from miles.config.args import Args
from miles.config.resolution import schema_args
from miles.core.errors import ConfigError
from miles.core.sample import Sample
from miles.rewards import dispatch
from miles.rewards.dispatch import RewardError, batched_async_rm, score_groups, score_samples
from miles.rewards.scorers.jpeg import image_to_uint8, jpeg_compressibility, jpeg_incompressibility, jpeg_size_kb
from miles.rewards.scorers.ocr import edit_distance, extract_target, load_ocr_engine, ocr_reward, score_text


# ---- helpers -----------------------------------------------------------------------------------
def text_image(text: str, size: int = 256, font_size: int = 48) -> torch.Tensor:
    """Black text on a white square, as a [3, H, W] float tensor in [0, 1]."""
    from PIL import Image, ImageDraw, ImageFont

    image = Image.new("RGB", (size, size), "white")
    ImageDraw.Draw(image).text((size // 10, size // 3), text, fill="black", font=ImageFont.load_default(font_size))
    return torch.from_numpy(np.array(image)).permute(2, 0, 1).float() / 255.0


def noise_image(seed: int = 0, size: int = 64) -> torch.Tensor:
    return torch.rand(3, size, size, generator=torch.Generator().manual_seed(seed))


def make_args(**overrides) -> Args:
    return schema_args(**overrides)


def sample(index: int, prompt: str, image, **metadata) -> Sample:
    return Sample(index=index, group_index=0, prompt=prompt, metadata=dict(metadata), image=image)


@pytest.fixture(scope="module")
def digit_ckpt(tmp_path_factory):
    """A checkpoint-like folder holding only `digit_classifier/` (fitted on the digits train split)."""
    from miles.models.digit_classifier import CLASSIFIER_DIRNAME, fit_digit_classifier, save_digit_classifier

    root = tmp_path_factory.mktemp("digit_ckpt")
    save_digit_classifier(*fit_digit_classifier(), root / CLASSIFIER_DIRNAME)
    return root


@pytest.fixture(scope="module")
def digit_images():
    from miles.data.digits import digits_to_rgb_uint8, load_digits_split

    split = load_digits_split()
    rgb = digits_to_rgb_uint8(split.test_x[:4])  # (4, 64, 64, 3) uint8
    images = [torch.from_numpy(im).permute(2, 0, 1).float() / 255.0 for im in rgb]
    return images, [int(y) for y in split.test_y[:4]]


# ---- JPEG (D.7.4) ------------------------------------------------------------------------------
def test_jpeg_constant_beats_noise_deterministic_and_relation():
    constant = torch.full((3, 64, 64), 0.3)
    noise = noise_image()
    images = [constant, noise]
    comp, incomp = jpeg_compressibility(images), jpeg_incompressibility(images)
    assert comp[0] > comp[1]  # constant colour is more compressible (less negative)
    assert incomp[1] > incomp[0] > 0
    assert jpeg_compressibility(images) == comp and jpeg_incompressibility(images) == incomp  # deterministic
    assert comp == [-size / 500 for size in incomp]  # flow_grpo's scaling: -kB / 500
    assert all(-1.0 < c < 0.0 for c in comp)


def test_jpeg_size_is_pil_quality95_kilobytes():
    import io

    from PIL import Image

    image = noise_image(1)
    buffer = io.BytesIO()
    Image.fromarray(image_to_uint8(image)).save(buffer, format="JPEG", quality=95)
    assert jpeg_size_kb(image) == buffer.tell() / 1000
    # every image layout reads the same pixels
    hwc = image.permute(1, 2, 0).numpy()
    u8 = image_to_uint8(image)
    assert u8.shape == (64, 64, 3) and u8.dtype == np.uint8
    assert np.array_equal(image_to_uint8(hwc), u8) and np.array_equal(image_to_uint8(u8), u8)
    assert np.array_equal(image_to_uint8(Image.fromarray(u8)), u8)
    with pytest.raises(ValueError, match="NaN"):
        image_to_uint8(torch.full((3, 4, 4), float("nan")))


# ---- OCR arithmetic (D.7.5) --------------------------------------------------------------------
def test_edit_distance():
    assert edit_distance("kitten", "sitting") == 3
    assert edit_distance("sitting", "kitten") == 3
    assert edit_distance("", "abc") == 3 and edit_distance("abc", "") == 3 and edit_distance("", "") == 0
    assert edit_distance("flaw", "lawn") == 2
    assert edit_distance("hello", "hello") == 0


def test_ocr_score_arithmetic():
    assert score_text("big hello world", "hello") == 1.0  # substring hit
    assert score_text("HeLLo", "hello") == 1.0  # case
    assert score_text("h e l l o", "hel lo") == 1.0  # spaces stripped on both sides
    assert score_text("", "hello") == 0.0  # empty recognition
    assert score_text("   ", "hello") == 0.0
    assert score_text("helo", "hello") == pytest.approx(0.8)  # one deletion
    assert score_text("jello", "hello") == pytest.approx(0.8)
    assert score_text("a very long unrelated sentence", "hi") == 0.0  # distance capped at len(target)
    assert 0.0 <= score_text("zzzzzzzzzzzzzzzz", "hello") <= 1.0
    with pytest.raises(ValueError):
        score_text("x", " ")


def test_ocr_target_extraction():
    assert extract_target('a sign that says "Hello World" and "other"') == "Hello World"
    with pytest.raises(ValueError, match="double quotes"):
        extract_target("a sign with no quotes")
    with pytest.raises(ValueError, match="double quotes"):
        extract_target('an unterminated "quote')
    with pytest.raises(ValueError, match="empty"):
        extract_target('empty "" target')


@pytest.mark.slow
def test_real_ocr_reads_rendered_text():
    import os

    assert os.environ.get("HF_HUB_OFFLINE") == "1"  # conftest; rapidocr reads its models from the wheel
    engine = load_ocr_engine()
    hello, blank = text_image("HELLO"), torch.ones(3, 256, 256)
    start = time.perf_counter()
    rewards = ocr_reward([hello, blank], ['a sign that says "hello"', 'a sign that says "hello"'], engine)
    per_image = (time.perf_counter() - start) / 2
    assert rewards[0] >= 0.8, engine.recognize(hello)
    assert rewards[1] == 0.0
    assert per_image < 5.0
    assert engine.recognize(text_image("MILES")).replace(" ", "").lower() == "miles"


# ---- PickScore (tiny random CLIP) --------------------------------------------------------------
def _hand_pickscore(model_dir: str, processor_dir: str, images, prompts) -> list[float]:
    from PIL import Image
    from transformers import CLIPModel, CLIPProcessor

    model = CLIPModel.from_pretrained(model_dir).eval()
    processor = CLIPProcessor.from_pretrained(processor_dir)
    text = processor.tokenizer(prompts, padding="max_length", truncation=True, max_length=77, return_tensors="pt")
    pixels = processor.image_processor(
        images=[Image.fromarray(image_to_uint8(im)) for im in images], return_tensors="pt"
    ).pixel_values
    with torch.no_grad():
        t = model.text_projection(model.text_model(**text).pooler_output)
        v = model.visual_projection(model.vision_model(pixel_values=pixels).pooler_output)
        t, v = t / t.norm(dim=-1, keepdim=True), v / v.norm(dim=-1, keepdim=True)
        scores = model.logit_scale.exp() * (t * v).sum(-1) / 26.0
    return scores.tolist()


def test_pickscore_tiny_clip_matches_hand_computation(tiny_clip):
    from miles.rewards.scorers.pickscore import pickscore_reward

    model_dir, processor_dir = tiny_clip
    images = [noise_image(i, size=48) for i in range(5)]
    prompts = ["a photo of a cat", "a photo of a dog", "a handwritten digit 3", "a blank image", "the number 7"]
    scores = pickscore_reward(images, prompts, model_dir, processor_dir, batch_size=8)
    assert len(scores) == 5 and all(math.isfinite(s) for s in scores)
    assert len(set(scores)) > 1
    assert pickscore_reward(images, prompts, model_dir, processor_dir, batch_size=8) == scores  # deterministic
    chunked = pickscore_reward(images, prompts, model_dir, processor_dir, batch_size=2)  # 3 forwards
    assert chunked == pytest.approx(scores, abs=1e-6)
    assert scores == pytest.approx(_hand_pickscore(model_dir, processor_dir, images, prompts), abs=1e-5)


def test_pickscore_video_averages_sampled_frames(tiny_clip):
    from miles.rewards.scorers.pickscore import frame_indices, pickscore_reward

    model_dir, processor_dir = tiny_clip
    frames = torch.stack([noise_image(i, size=32) for i in range(4)])  # (F, 3, H, W)
    per_frame = pickscore_reward(list(frames), ["a photo of a cat"] * 4, model_dir, processor_dir)
    video = pickscore_reward([frames], ["a photo of a cat"], model_dir, processor_dir, num_frames=2)
    assert frame_indices(4, 2) == [0, 3] and frame_indices(4, None) == [0, 1, 2, 3]
    assert video[0] == pytest.approx((per_frame[0] + per_frame[3]) / 2, abs=1e-6)


# ---- dispatch ----------------------------------------------------------------------------------
@pytest.mark.slow  # over a second: not in the fast tier
def test_dispatch_mixed_types_batches_each_type_once(tiny_clip, digit_ckpt, digit_images, monkeypatch):
    from miles.rewards.scorers.digit import digit_reward, load_digit_classifier
    from miles.rewards.scorers.pickscore import pickscore_reward

    model_dir, processor_dir = tiny_clip
    args = make_args(
        rm_type="jpeg_compressibility",
        hf_checkpoint=str(digit_ckpt),
        pickscore_model_path=model_dir,
        pickscore_processor_path=processor_dir,
        pickscore_batch_size=2,
    )
    (d0, d1), (y0, y1) = digit_images[0][:2], digit_images[1][:2]
    hello = text_image("HELLO")
    samples = [
        sample(0, "noise", noise_image(0)),  # --rm-type default
        sample(1, "a photo of a cat", noise_image(1, 32), rm_type="pickscore"),
        sample(2, f"a handwritten digit {y0}", d0, rm_type="digit", label=y0),
        sample(3, 'a sign that says "hello"', hello, rm_type="ocr"),
        sample(4, "more noise", noise_image(4), rm_type="jpeg_incompressibility"),
        sample(5, "a photo of a dog", noise_image(5, 32), rm_type="pickscore"),
        sample(6, f"a handwritten digit {y1}", d1, rm_type="digit", label=y1),
        sample(7, "flat", torch.full((3, 64, 64), 0.5)),
    ]
    calls: list[tuple[str, int]] = []
    real = dispatch._cached_scorer

    def counting(settings, rm_type):
        scorer = real(settings, rm_type)

        def wrapped(images, prompts, metadata):
            calls.append((rm_type, len(images)))
            return scorer(images, prompts, metadata)

        return wrapped

    monkeypatch.setattr(dispatch, "_cached_scorer", counting)
    rewards = asyncio.run(batched_async_rm(args, samples))
    assert sorted(calls) == sorted(
        [("jpeg_compressibility", 2), ("pickscore", 2), ("digit", 2), ("ocr", 1), ("jpeg_incompressibility", 1)]
    )
    clf = load_digit_classifier(digit_ckpt)
    expected = {
        0: jpeg_compressibility([samples[0].image])[0],
        7: jpeg_compressibility([samples[7].image])[0],
        4: jpeg_incompressibility([samples[4].image])[0],
        3: ocr_reward([hello], [samples[3].prompt])[0],
    }
    ps = pickscore_reward([samples[1].image, samples[5].image], [samples[1].prompt, samples[5].prompt], *tiny_clip)
    expected[1], expected[5] = ps
    expected[2], expected[6] = digit_reward([d0, d1], [y0, y1], clf, value_range="0,1")
    assert all(isinstance(r, float) for r in rewards)
    assert rewards == pytest.approx([expected[i] for i in range(8)], abs=1e-6)
    assert rewards[2] > 0.5 and rewards[6] > 0.5  # real digits, right labels


def test_dispatch_digit_from_builtin_checkpoint_name(digit_ckpt, digit_images, monkeypatch):
    """`--hf-checkpoint tiny-sd3` resolves through miles.builtin.checkpoints.ensure_checkpoint."""
    import miles.builtin.checkpoints as checkpoints

    seen = []

    def fake_ensure(name, progress=True, seed=0):
        seen.append(name)
        return digit_ckpt

    monkeypatch.setattr(checkpoints, "ensure_checkpoint", fake_ensure)
    dispatch._cached_scorer.cache_clear()
    images, labels = digit_images
    args = make_args(rm_type="digit", hf_checkpoint="tiny-sd3")
    rewards = asyncio.run(
        batched_async_rm(
            args, [sample(i, "d", im, label=y) for i, (im, y) in enumerate(zip(images, labels, strict=True))]
        )
    )
    dispatch._cached_scorer.cache_clear()
    assert seen == ["tiny-sd3"] and len(rewards) == 4 and min(rewards) > 0.5


def test_dispatch_errors_name_type_and_sample(digit_ckpt):
    image = noise_image()
    args = make_args(rm_type="digit", hf_checkpoint=str(digit_ckpt))
    bad = [sample(3, "a handwritten digit 1", image, label=1), sample(5, "no label here", image)]
    with pytest.raises(RewardError, match=r"'digit'.*sample 5 \(prompt 'no label here'\).*metadata.label"):
        asyncio.run(batched_async_rm(args, bad))
    with pytest.raises(RewardError, match=r"sample 2.*no image"):
        asyncio.run(batched_async_rm(make_args(rm_type="jpeg_compressibility"), [sample(2, "p", None)]))
    with pytest.raises(ConfigError, match=r"unknown reward type 'hpsv3' for sample 9"):
        asyncio.run(batched_async_rm(args, [sample(9, "p", image, rm_type="hpsv3")]))
    with pytest.raises(ConfigError, match=r"remote_rm requires --rm-url"):
        asyncio.run(batched_async_rm(make_args(rm_type="remote_rm"), [sample(0, "p", image)]))
    with pytest.raises(ConfigError, match="no reward type for sample 4"):
        asyncio.run(batched_async_rm(make_args(), [sample(4, "p", image)]))
    with pytest.raises(ConfigError, match="--pickscore-model-path"):
        asyncio.run(batched_async_rm(make_args(rm_type="pickscore"), [sample(0, "p", image)]))
    assert asyncio.run(batched_async_rm(args, [])) == []


def test_dispatch_ocr_prompt_without_quotes_names_the_sample():
    args = make_args(rm_type="ocr")
    samples = [sample(0, 'say "hi"', torch.ones(3, 64, 64)), sample(7, "a sign without quotes", torch.ones(3, 64, 64))]
    with pytest.raises(RewardError, match=r"'ocr'.*sample 7 \(prompt 'a sign without quotes'\).*double quotes"):
        asyncio.run(batched_async_rm(args, samples))


CUSTOM_RM = textwrap.dedent(
    """
    CALLS = []

    async def dict_rm(args, samples, **kwargs):
        CALLS.append((len(samples), kwargs))
        return [{"length": float(len(s.prompt)), "index": s.index} for s in samples]

    def sync_rm(args, samples, **kwargs):
        return [args.rm_url == "http://x" and 1.0 or 0.0 for s in samples]

    async def short_rm(args, samples, **kwargs):
        return [1.0]

    async def broken_rm(args, samples, **kwargs):
        raise KeyError("score")
    """
)


@pytest.fixture
def custom_module(tmp_path, monkeypatch):
    import importlib
    import sys

    (tmp_path / "my_rewards.py").write_text(CUSTOM_RM)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_rewards", None)
    dispatch.load_custom_rm.cache_clear()
    yield importlib.import_module("my_rewards")
    sys.modules.pop("my_rewards", None)
    dispatch.load_custom_rm.cache_clear()


def test_custom_rm_replaces_dispatch_and_keeps_dicts(custom_module):
    args = make_args(rm_type="ocr", custom_rm_path="my_rewards.dict_rm", reward_key="length")
    samples = [sample(i, "p" * (i + 1), None, rm_type="aesthetic") for i in range(3)]  # never dispatched
    rewards = asyncio.run(score_samples(args, samples, evaluation=True))
    assert rewards == [{"length": 1.0, "index": 0.0}, {"length": 2.0, "index": 1.0}, {"length": 3.0, "index": 2.0}]
    assert [s.scalar_reward(args.reward_key) for s in samples] == [1.0, 2.0, 3.0]
    assert custom_module.CALLS == [(3, {"evaluation": True})]  # one batched call, kwargs passed through
    sync_args = make_args(custom_rm_path="my_rewards.sync_rm", rm_url="http://x")
    assert asyncio.run(batched_async_rm(sync_args, samples)) == [1.0, 1.0, 1.0]


def test_custom_rm_errors(custom_module):
    samples = [sample(i, f"prompt {i}", None) for i in range(2)]
    with pytest.raises(RewardError, match="returned 1 rewards for 2 samples"):
        asyncio.run(batched_async_rm(make_args(custom_rm_path="my_rewards.short_rm"), samples))
    with pytest.raises(RewardError, match=r"my_rewards.broken_rm failed on 2 samples: sample 0 .*KeyError"):
        asyncio.run(batched_async_rm(make_args(custom_rm_path="my_rewards.broken_rm"), samples))
    with pytest.raises(ConfigError, match="cannot import"):
        asyncio.run(batched_async_rm(make_args(custom_rm_path="my_rewards.missing"), samples))


def test_group_rm_scores_each_whole_group_once(custom_module):
    args = make_args(custom_rm_path="my_rewards.dict_rm", group_rm=True)
    groups = [[sample(g * 4 + i, f"group {g}", None) for i in range(4)] for g in range(3)]
    rewards = asyncio.run(score_groups(args, groups))
    assert [len(r) for r in rewards] == [4, 4, 4]
    assert sorted(n for n, _ in custom_module.CALLS) == [4, 4, 4]  # one call per whole group
    assert [s.reward["index"] for g in groups for s in g] == list(range(12))
    # the built-in dispatch serves groups the same way
    jpeg_groups = [[sample(i, "x", noise_image(i)) for i in range(2)], [sample(2, "y", torch.zeros(3, 64, 64))]]
    out = asyncio.run(score_groups(make_args(rm_type="jpeg_incompressibility"), jpeg_groups))
    assert out == [jpeg_incompressibility([s.image for s in g]) for g in jpeg_groups]
