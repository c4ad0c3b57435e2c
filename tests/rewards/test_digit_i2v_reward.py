"""The digit image-to-video reward (`digit_i2v`: "the digit 7 moving left" from a first frame to keep) on the moving
digits of the test split, each case scored against the ground-truth video's first frame:
`mean_f p_label * travel * agreement * place`.

The classifier is a small one fitted here (logistic regression on the moving-digit crops of 400 train digits, about a
second) so that the cases run in the fast tier; the stored video classifier's numbers are in docs/rewards.md.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from miles.config.resolution import schema_args
from miles.core.sample import Sample
from miles.data.digits_video import DIRECTIONS, render_video
from miles.rewards.dispatch import batched_async_rm, check_reward_inputs
from miles.rewards.errors import RewardError
from miles.rewards.scorers.digit_i2v import i2v_terms

NUM = 40  # test digits, directions in turn
OPPOSITE = {"right": "left", "left": "right", "down": "up", "up": "down"}


@pytest.fixture(scope="module")
def classifier(digits_split):
    from sklearn.linear_model import LogisticRegression

    from miles.models.digit_classifier import digits_to_features, moving_digit_crops

    x8, y = moving_digit_crops(digits_split.train_x[:400], digits_split.train_y[:400])
    return LogisticRegression(C=1.0, max_iter=300).fit(digits_to_features(x8), y)


def rgb(gray: np.ndarray) -> torch.Tensor:
    """(F, H, W) gray -> a video sample [3, F, H, W]."""
    return torch.from_numpy(np.ascontiguousarray(gray))[None].expand(3, -1, -1, -1).clone()


@pytest.fixture(scope="module")
def cases(digits_split):
    """case -> the videos of the NUM test digits; and the conditions, labels and directions they are scored on."""
    x8, y = digits_split.test_x, digits_split.test_y
    directions = [DIRECTIONS[i % 4] for i in range(NUM)]
    truth = [render_video(x8[i], directions[i]) for i in range(NUM)]
    others = []  # the next test digit of another class, moving the same way from the same edge
    for i in range(NUM):
        j = next(k for k in range(NUM, len(y)) if y[k] != y[i])
        others.append(render_video(x8[j], directions[i]))
    out = {
        "truth": [rgb(v) for v in truth],
        "truth, 5 frames": [rgb(v[::2]) for v in truth],  # the recipes' clips: every 2nd frame
        "first frame copied": [rgb(np.repeat(v[:1], len(v), axis=0)) for v in truth],
        "opposite direction": [rgb(render_video(x8[i], OPPOSITE[d])) for i, d in enumerate(directions)],
        "frames reversed": [rgb(v[::-1].copy()) for v in truth],
        "another digit": [rgb(v) for v in others],
        "half the way": [rgb(v[:5]) for v in truth],
    }
    conditions = [torch.from_numpy(v[0])[None].expand(3, -1, -1).clone() for v in truth]
    return out, conditions, [int(k) for k in y[:NUM]], directions


def scored(cases, classifier, name):
    videos, conditions, labels, directions = cases[0][name], *cases[1:]
    frames_first = [v.permute(1, 0, 2, 3) for v in videos]
    return i2v_terms(frames_first, conditions, labels, directions, classifier)


def test_the_ground_truth_scores_its_digit_reward(cases, classifier) -> None:
    """The data's own video keeps its first frame exactly and crosses the whole way: its reward is the digit reward,
    mean_f p_label (0.917 here over 40 videos; a few digits the small classifier misreads pull it down)."""
    for name in ("truth", "truth, 5 frames"):
        terms = scored(cases, classifier, name)
        for t in terms:
            assert (t.travel, t.agreement, t.place, t.offset) == pytest.approx((1.0, 1.0, 1.0, 0.0), abs=1e-6)
            assert t.reward == pytest.approx(t.p_label, abs=1e-6) and t.along == pytest.approx(0.5)
        rewards = np.array([t.reward for t in terms])
        assert 0.9 < rewards.mean() <= 1.0 and np.median(rewards) > 0.97, name


def test_copying_moving_back_or_another_digit_score_near_zero(cases, classifier) -> None:
    """The first frame copied into every frame (no motion), the digit moving the other way (from the other edge, or
    the true video backwards) and another digit drawn score ~0; half the crossing scores half."""
    truth = np.array([t.reward for t in scored(cases, classifier, "truth")])
    copied = scored(cases, classifier, "first frame copied")
    assert all(t.travel == 0.0 and t.reward == 0.0 and t.keep == pytest.approx(1.0) for t in copied)
    for name in ("opposite direction", "frames reversed"):
        terms = scored(cases, classifier, name)
        assert all(t.travel == 0.0 and t.reward == 0.0 for t in terms), name
        assert all(t.place < 1e-3 and t.offset == pytest.approx(1.0) for t in terms), name  # a digit's side away
    other = scored(cases, classifier, "another digit")
    rewards = np.array([t.reward for t in other])
    assert rewards.mean() < 0.02 and rewards.max() < 0.1  # 0.007 and 0.053 here
    assert np.mean([t.p_label for t in other]) < 0.05 and np.mean([t.agreement for t in other]) < 0.3
    half = scored(cases, classifier, "half the way")  # 4 of 8 steps: travel 1/2 (p_label over its 5 frames)
    assert all(t.travel == pytest.approx(0.5) and t.reward == pytest.approx(t.p_label / 2) for t in half)
    assert np.mean([t.reward for t in half]) == pytest.approx(truth.mean() / 2, abs=0.01)


def test_drift_and_a_moved_first_frame_cost_as_gaussians(cases, classifier) -> None:
    """8 px (a quarter of the 32-px travel, a quarter of the 32-px digit) across the direction, or between the first
    frames, costs exp(-1/2)."""
    truth = cases[0]["truth"][0].permute(1, 0, 2, 3)  # "right": the digit crosses the middle rows
    assert cases[3][0] == "right"
    drift = truth.clone()
    drift[-1] = torch.roll(truth[-1], 8, dims=-2)  # the last frame 8 px lower
    shifted = torch.roll(truth, 8, dims=-2)  # every frame 8 px lower
    base, drifted, moved = i2v_terms(
        [truth, drift, shifted], [cases[1][0]] * 3, [cases[2][0]] * 3, ["right"] * 3, classifier
    )
    assert drifted.travel == pytest.approx(np.exp(-0.5), abs=1e-6) and drifted.place == 1.0
    assert moved.travel == 1.0 and moved.offset == pytest.approx(0.25) and moved.place == pytest.approx(np.exp(-0.5))
    assert moved.agreement > 0.99 and moved.reward == pytest.approx(base.reward * np.exp(-0.5), rel=0.02)


def test_digit_i2v_through_the_dispatch(tmp_path, cases, classifier) -> None:
    """`--rm-type digit_i2v`: the classifier of --hf-checkpoint, metadata.label and metadata.direction, the sample's
    first condition image; an image sample and a row without a direction are refused in one line."""
    from miles.models.digit_classifier import save_digit_classifier

    save_digit_classifier(classifier, {"input": "video"}, tmp_path)
    args = schema_args(rm_type=["digit_i2v"], hf_checkpoint=str(tmp_path))
    videos, conditions, labels, directions = cases[0]["truth"][:2], cases[1][:2], cases[2][:2], cases[3][:2]
    videos = [*videos, cases[0]["first frame copied"][0]]
    conditions, labels, directions = [*conditions, conditions[0]], [*labels, labels[0]], [*directions, directions[0]]
    samples = [
        Sample(
            index=i,
            group_index=i,
            prompt=f"the digit {k} moving {d}",
            metadata={"label": k, "direction": d},
            image=v,
            sources=[c, torch.zeros(3, 64, 64)],  # a second condition image is not read
        )
        for i, (v, c, k, d) in enumerate(zip(videos, conditions, labels, directions, strict=True))
    ]
    got = asyncio.run(batched_async_rm(args, samples))
    expected = [t.reward for t in scored(cases, classifier, "truth")[:2]] + [0.0]
    assert got == pytest.approx(expected, abs=1e-12) and min(got[:2]) > 0.9

    samples[0].image = conditions[0]
    with pytest.raises(RewardError, match=r"digit_i2v scores an image-to-video output, got an image"):
        asyncio.run(batched_async_rm(args, samples[:1]))
    samples[1].metadata = {"label": labels[1]}
    with pytest.raises(RewardError, match=r"sample 1 .*metadata\.direction"):
        asyncio.run(batched_async_rm(args, samples[1:2]))
    with pytest.raises(ValueError, match=r"metadata\.direction, one of right, left, down, up; the row has 'east'"):
        check_reward_inputs("digit_i2v", "the digit 3 moving east", {"label": 3, "direction": "east"})
    check_reward_inputs("digit_i2v", "the digit 3 moving up", {"label": 3, "direction": "up"})


def test_the_eval_metrics_of_image_to_video_samples(cases, classifier) -> None:
    """An I2V eval sample carries its source: its video is still read per frame (accuracy, direction_acc), not at
    an edit's crop."""
    from miles.rewards.scorers.digit_metrics import digit_eval_metrics

    videos, conditions, labels, directions = cases[0]["truth"][:4], cases[1][:4], cases[2][:4], cases[3][:4]
    metadata = [{"label": k, "direction": d} for k, d in zip(labels, directions, strict=True)]
    with_sources = digit_eval_metrics(videos, metadata, classifier, sources=conditions)
    assert with_sources == digit_eval_metrics(videos, metadata, classifier)
    assert with_sources["direction_acc"] == 1.0 and with_sources["accuracy"] > 0.8
