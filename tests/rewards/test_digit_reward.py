"""The digit reward, accuracy and Fréchet distance on the classifier stored with tiny-sd3."""

from __future__ import annotations

import numpy as np
import pytest

from miles.data.digits import digits_to_rgb_uint8, upsample_digits
from miles.rewards.scorers.digit import digit_reward, images_to_digits, load_digit_classifier
from miles.rewards.scorers.digit_metrics import digit_accuracy, digit_fd, digit_features, frechet_distance


@pytest.fixture(scope="module")
def real(digits_split):
    return digits_to_rgb_uint8(digits_split.test_x), digits_split.test_y


@pytest.mark.slow  # the session's tiny-sd3 build (a minute or two cold): not in the fast tier
def test_classifier_is_stored_and_accurate(tiny_sd3_dir, digit_classifier, real):
    from miles.rewards.scorers.digit import read_classifier_metadata

    assert (tiny_sd3_dir / "digit_classifier" / "classifier.json").is_file()
    meta = read_classifier_metadata(tiny_sd3_dir)
    assert meta["test_accuracy"] >= 0.97 and meta["classes"] == list(range(10))
    images, labels = real
    assert digit_accuracy(images, labels, digit_classifier) >= 0.97
    assert load_digit_classifier(tiny_sd3_dir) is digit_classifier  # cached
    assert load_digit_classifier() is digit_classifier  # default: the session's tiny-sd3


@pytest.mark.slow  # the session's tiny-sd3 build (a minute or two cold): not in the fast tier
def test_reward_right_vs_wrong_label(digit_classifier, real):
    images, labels = real
    right = np.array(digit_reward(images, labels, digit_classifier))
    wrong = np.array(digit_reward(images, (labels + 1) % 10, digit_classifier))
    assert right.shape == (360,) and ((right >= 0) & (right <= 1)).all()
    assert right.mean() > 0.9 and np.median(right) > 0.95
    assert wrong.mean() < 0.05


@pytest.mark.slow  # the session's tiny-sd3 build (a minute or two cold): not in the fast tier
def test_reward_accepts_every_image_format(digit_classifier, digits_split):
    import torch
    from PIL import Image

    x8, labels = digits_split.test_x[:16], digits_split.test_y[:16]
    ref = np.array(digit_reward(x8, labels, digit_classifier))  # the exact 8x8 digits
    gray64 = upsample_digits(x8)
    uint8_nhwc = digits_to_rgb_uint8(x8)
    chw01 = torch.from_numpy(gray64)[:, None].expand(-1, 3, -1, -1)
    variants = {
        "pil": [Image.fromarray(im) for im in uint8_nhwc],
        "uint8 NHWC": uint8_nhwc,
        "torch NCHW [0,1]": chw01,
        "torch NCHW [-1,1]": chw01 * 2 - 1,
        "numpy NHWC float": uint8_nhwc.astype(np.float32) / 255.0,
        "gray NHW": gray64,
        "list of CHW": [c for c in chw01],
        "1 channel": chw01[:, :1],
    }
    for name, images in variants.items():
        got = np.array(digit_reward(images, labels, digit_classifier))
        assert np.allclose(got, ref, atol=1e-2), name
    # one image, any size
    single = digit_reward(
        Image.fromarray(uint8_nhwc[0]).resize((100, 100), Image.BILINEAR), [labels[0]], digit_classifier
    )
    assert single[0] > 0.5
    resized = [Image.fromarray(im).resize((37, 37), Image.BILINEAR) for im in uint8_nhwc]
    assert digit_accuracy(resized, labels, digit_classifier) >= 0.8
    with pytest.raises(ValueError, match="16 images but 3 labels"):
        digit_reward(uint8_nhwc, [1, 2, 3], digit_classifier)


def test_images_to_digits_ranges():
    img = np.zeros((1, 3, 64, 64), dtype=np.float32)
    img[..., :8, :8] = 1.0
    assert images_to_digits(img)[0, 0, 0] == 1.0
    signed = img * 2 - 1
    assert images_to_digits(signed)[0, 0, 0] == 1.0 and images_to_digits(signed)[0, 1, 1] == 0.0
    assert images_to_digits(signed, value_range="-1,1")[0, 1, 1] == 0.0
    with pytest.raises(ValueError):
        images_to_digits(img, value_range="0-255")


@pytest.mark.slow  # the session's tiny-sd3 build (a minute or two cold): not in the fast tier
def test_frechet_distance(digit_classifier, real):
    images, _ = real
    rng = np.random.default_rng(0)
    feats = digit_features(images, digit_classifier)
    assert feats.shape == (360, 10)
    half_a, half_b = feats[::2], feats[1::2]
    noise = rng.random((180, 64, 64, 3), dtype=np.float32)
    fd_real = frechet_distance(half_a, half_b)
    fd_noise = frechet_distance(half_a, digit_features(noise, digit_classifier))
    assert fd_real < 0.1 * fd_noise
    assert frechet_distance(half_a, half_a) == pytest.approx(0.0, abs=1e-6)
    assert digit_fd(images, digit_classifier) < 0.01 * fd_noise  # the same test split (uint8-rounded)
    with pytest.raises(ValueError):
        frechet_distance(half_a, half_b[:, :5])


@pytest.mark.slow  # the session's tiny-sd3 build (a minute or two cold): not in the fast tier
def test_generated_images_can_be_scored(tiny_sd3_pipeline, digit_classifier):
    import torch

    out = tiny_sd3_pipeline(
        ["a handwritten digit 3"] * 4,
        num_inference_steps=3,
        guidance_scale=1.0,
        max_sequence_length=8,
        generator=torch.Generator().manual_seed(0),
        output_type="pt",
    )
    rewards = digit_reward(out.images, [3] * 4, digit_classifier)
    assert len(rewards) == 4 and all(0.0 <= r <= 1.0 for r in rewards)
