"""The CLIP-score reward (`scorers.clip_score`) on a tiny random CLIP built offline (the session's `tiny_clip`: a
random `CLIPModel` and a `CLIPProcessor` whose BPE tokenizer is laid out from a small corpus), checked against the
formula `scale * max(cos(image, text), 0)` computed by hand; plus the shared frame/chunk plumbing and the
torchvision-free eval transform the other scorers use."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from reward_helpers import eval_pixels, noise_image, normalized, to_uint8

from miles.rewards.scorers.clip_score import CLIP_SCORE_SCALE, clip_pixels, load_clip_score, resize_center_crop

# with the tiny random CLIP, three positive cosines and two negative ones (clamped to 0): both branches are checked
PROMPTS = ["the number 1", "a photo of a cat", "the number 4", "a handwritten digit 3", "the number six"]


def hand_cosines(model_dir: str, processor_dir: str, images: list[torch.Tensor], prompts: list[str]) -> torch.Tensor:
    from PIL import Image
    from transformers import CLIPModel, CLIPProcessor

    model = CLIPModel.from_pretrained(model_dir).eval()
    processor = CLIPProcessor.from_pretrained(processor_dir)
    text = processor.tokenizer(prompts, padding="max_length", truncation=True, max_length=77, return_tensors="pt")
    pixels = processor.image_processor(
        images=[Image.fromarray(to_uint8(im)) for im in images], return_tensors="pt"
    ).pixel_values
    with torch.no_grad():
        t = model.text_model(**text).pooler_output @ model.text_projection.weight.T
        v = model.vision_model(pixel_values=pixels).pooler_output @ model.visual_projection.weight.T
    return (normalized(t) * normalized(v)).sum(-1)


@pytest.mark.slow
def test_clip_score_tiny_random_weights(tiny_clip):
    model_dir, processor_dir = tiny_clip
    images = [noise_image(i, 48, 40) for i in range(5)]
    cos = hand_cosines(model_dir, processor_dir, images, PROMPTS)
    assert (cos > 0.05).sum() >= 2 and (cos < 0).sum() >= 1

    scorer = load_clip_score(model_dir, processor_dir, batch_size=2)  # 3 chunked forwards
    assert str(scorer.device) in ("cpu", "cuda", "cuda:0")
    scores = scorer.score(images, PROMPTS)
    assert scores == pytest.approx((CLIP_SCORE_SCALE * cos.clamp_min(0)).tolist(), abs=1e-5)
    assert pytest.approx(100 / 30) == CLIP_SCORE_SCALE

    # numpy input, another scale: w = 100 is torchmetrics' CLIPScore
    torchmetrics = load_clip_score(model_dir, processor_dir, scale=100.0, batch_size=8)
    as_numpy = torchmetrics.score([im.numpy() for im in images], PROMPTS)
    assert as_numpy == pytest.approx((100 * cos.clamp_min(0)).tolist(), abs=1e-4)


@pytest.mark.slow
def test_clip_score_averages_video_frames(tiny_clip):
    model_dir, processor_dir = tiny_clip
    frames = torch.stack([noise_image(10 + i) for i in range(4)])  # (F, 3, H, W)
    cos = hand_cosines(model_dir, processor_dir, list(frames), ["the number 1"] * 4)
    per_frame = CLIP_SCORE_SCALE * cos.clamp_min(0)
    assert (per_frame > 0).all() and len(set(per_frame.tolist())) == 4

    scorer = load_clip_score(model_dir, processor_dir, num_frames=2)
    (video,) = scorer.score([frames], ["the number 1"])
    assert video == pytest.approx(float((per_frame[0] + per_frame[3]) / 2), abs=1e-5)  # frames 0 and 3
    every = load_clip_score(model_dir, processor_dir).score([frames], ["the number 1"])
    assert every[0] == pytest.approx(float(per_frame.mean()), abs=1e-5)
    assert scorer.score([], []) == []
    with pytest.raises(ValueError, match="2 images but 1 prompts"):
        scorer.score([frames[0], frames[1]], ["a"])


def test_clip_pixels_is_torchvisions_resize_center_crop_normalize():
    for seed, (h, w) in enumerate([(48, 40), (40, 48), (32, 32), (20, 70), (225, 224)]):
        image = noise_image(seed, h, w)
        expected = eval_pixels(image, 32)
        got = clip_pixels([to_uint8(image)], 32)
        assert got.shape == (1, 3, 32, 32)
        assert torch.allclose(got[0], expected, atol=1e-6), (h, w)
    assert resize_center_crop(np.zeros((10, 30, 3), np.uint8), 8).shape == (8, 8, 3)
