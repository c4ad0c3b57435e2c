"""Rewards and eval metrics on video samples `[3, F, H, W]`: the digit reward (mean over frames of the video
classifier's probability), per-frame accuracy, fd over frames, direction accuracy, and PickScore on sampled
frames through the reward dispatch (the real tiny CLIP)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from miles.config.args import Args
from miles.config.resolution import schema_args
from miles.core.errors import ConfigError
from miles.core.sample import Sample
from miles.data.digits_video import DIRECTIONS, NUM_FRAMES, render_video
from miles.rewards.dispatch import RewardSettings, batched_async_rm
from miles.rewards.scorers.digit import digit_probabilities, digit_reward, sample_digits
from miles.rewards.scorers.digit_metrics import (
    digit_accuracy,
    digit_eval_metrics,
    digit_fd,
    digit_features,
    direction_accuracy,
    video_directions,
)

NUM_VIDEOS = 80


@pytest.fixture(scope="module")
def video_classifier():
    from miles.models.digit_classifier import fit_digit_classifier

    clf, meta = fit_digit_classifier(video=True)
    assert meta["input"] == "video"
    return clf


@pytest.fixture(scope="module")
def rendered(digits_split):
    """The first NUM_VIDEOS test digits as video samples [3, F, 64, 64], directions in turn."""
    x, y = digits_split.test_x[:NUM_VIDEOS], digits_split.test_y[:NUM_VIDEOS]
    directions = [DIRECTIONS[i % 4] for i in range(NUM_VIDEOS)]
    videos = [
        torch.from_numpy(render_video(d, k))[None].expand(3, -1, -1, -1) for d, k in zip(x, directions, strict=True)
    ]
    return videos, [int(v) for v in y], directions


@pytest.mark.slow  # over a second (a build, a video set, a spawned process)
def test_video_reward_right_vs_wrong_label(video_classifier, rendered):
    videos, labels, _ = rendered
    right = np.array(digit_reward(videos, labels, video_classifier, value_range="0,1"))
    wrong = np.array(digit_reward(videos, [(k + 1) % 10 for k in labels], video_classifier, value_range="0,1"))
    assert right.shape == (NUM_VIDEOS,) and ((right >= 0) & (right <= 1)).all()
    assert right.mean() > 0.9 and wrong.mean() < 0.1
    # the reward of a video is the mean over its frames of the probability of its label
    from miles.models.digit_classifier import digits_to_features, videos_to_digits

    probs = video_classifier.predict_proba(digits_to_features(videos_to_digits([videos[0]], "0,1")))
    assert probs.shape == (NUM_FRAMES, 10)
    assert right[0] == pytest.approx(probs[:, labels[0]].mean(), abs=1e-12)
    # a batch tensor [N, 3, F, H, W] and [-1, 1] values read the same
    batch = torch.stack(videos[:8])
    assert digit_reward(batch * 2 - 1, labels[:8], video_classifier) == pytest.approx(right[:8].tolist(), abs=1e-9)
    with pytest.raises(ValueError, match="8 images but 3 labels"):
        digit_reward(batch, [1, 2, 3], video_classifier)


@pytest.mark.slow  # the module's video classifier fit (~6 s): not in the fast tier
def test_mixed_images_and_videos_keep_their_order(video_classifier, rendered, digits_split):
    from miles.data.digits import digits_to_rgb_uint8

    videos, labels, _ = rendered
    image = torch.from_numpy(digits_to_rgb_uint8(digits_split.test_x[:1])[0]).permute(2, 0, 1).float() / 255.0
    items = [videos[0], image, videos[1]]
    x8, owner = sample_digits(items, "0,1")
    assert owner.tolist() == [0] * NUM_FRAMES + [1] + [2] * NUM_FRAMES and x8.shape == (2 * NUM_FRAMES + 1, 8, 8)
    mixed = digit_reward(items, [labels[0], int(digits_split.test_y[0]), labels[1]], video_classifier, "0,1")
    alone = digit_reward([videos[0], videos[1]], labels[:2], video_classifier, "0,1")
    assert [mixed[0], mixed[2]] == pytest.approx(alone, abs=1e-12)
    probs = digit_probabilities(items, video_classifier, "0,1")
    assert probs.shape == (3, 10) and np.allclose(probs.sum(1), 1.0)
    assert probs[0, labels[0]] == pytest.approx(mixed[0], abs=1e-12)


@pytest.mark.slow  # over a second (a build, a video set, a spawned process)
def test_per_frame_accuracy_fd_and_direction(video_classifier, rendered):
    videos, labels, directions = rendered
    from miles.models.digit_classifier import digits_to_features, videos_to_digits

    acc = digit_accuracy(videos, labels, video_classifier)
    pred = video_classifier.predict(digits_to_features(videos_to_digits(videos, "0,1")))
    assert acc == pytest.approx(float((pred == np.repeat(labels, NUM_FRAMES)).mean()))  # over frames and videos
    assert 0.95 <= acc < 1.0  # 0.964 (694 of 720 frames) here; some frames of some digits are misread
    assert digit_features(videos, video_classifier).shape == (NUM_VIDEOS * NUM_FRAMES, 10)
    assert video_directions(videos) == directions
    assert direction_accuracy(videos, directions) == 1.0
    reversed_videos = [v.flip(1) for v in videos]  # frames backwards: every digit travels the other way
    assert direction_accuracy(reversed_videos, directions) == 0.0
    blank = [torch.zeros(3, NUM_FRAMES, 64, 64)]
    assert video_directions(blank) == ["none"]
    # fd over frames: real moving digits sit far closer to the real digits than noise does
    noise = [torch.rand(3, NUM_FRAMES, 64, 64, generator=torch.Generator().manual_seed(i)) for i in range(12)]
    fd_real, fd_noise = digit_fd(videos, video_classifier), digit_fd(noise, video_classifier)
    assert fd_real < 0.05 * fd_noise  # 5.9 vs ~300: against the frames of the real test split's moving digits
    from miles.rewards.scorers.digit_metrics import reference_features

    reference = reference_features(video_classifier, video=True)
    assert reference.shape == (360 * NUM_FRAMES, 10)

    metadata = [{"label": k, "direction": d} for k, d in zip(labels, directions, strict=True)]
    metrics = digit_eval_metrics(videos, metadata, video_classifier)
    assert set(metrics) == {"accuracy", "fd", "direction_acc"}
    assert metrics["accuracy"] == pytest.approx(acc) and metrics["direction_acc"] == 1.0
    assert metrics["fd"] == pytest.approx(fd_real)
    # one video of four with its frames reversed: direction_acc 0.75; without directions there is no key
    half = digit_eval_metrics([videos[0].flip(1), *videos[1:4]], metadata[:4], video_classifier)
    assert half["direction_acc"] == 0.75 and "fd" in half  # 36 frames: enough for fd
    plain = digit_eval_metrics(videos[:1], [{"label": labels[0]}], video_classifier)
    assert set(plain) == {"accuracy"}


@pytest.mark.slow  # the module's video classifier fit (~6 s): not in the fast tier
def test_eval_metrics_of_video_samples(tmp_path, video_classifier, rendered):
    from miles.models.digit_classifier import CLASSIFIER_DIRNAME, save_digit_classifier
    from miles.rollout.evaluation import eval_metrics

    save_digit_classifier(video_classifier, {"input": "video"}, tmp_path / CLASSIFIER_DIRNAME)
    videos, labels, directions = rendered
    samples = [
        Sample(index=i, group_index=i, prompt="p", metadata={"label": k, "direction": d}, image=v, reward=0.5)
        for i, (v, k, d) in enumerate(zip(videos[:8], labels[:8], directions[:8], strict=True))
    ]
    samples[0].image = samples[0].image.flip(1)
    args = schema_args(eval_reward_key=None, reward_key=None, hf_checkpoint=str(tmp_path))
    out = eval_metrics(args, "mv", samples)
    assert out["eval/mv/reward_mean"] == 0.5 and out["eval/mv/num_samples"] == 8.0
    assert out["eval/mv/direction_acc"] == 0.875
    assert out["eval/mv/accuracy"] >= 0.95 and "eval/mv/fd" in out


# ---- dispatch: digit and PickScore on videos ---------------------------------------------------
def _args(**overrides) -> Args:
    return schema_args(**overrides)


@pytest.mark.slow  # the module's video classifier fit (~6 s): not in the fast tier
def test_dispatch_scores_video_samples_with_the_digit_reward(tmp_path, video_classifier, rendered):
    from miles.models.digit_classifier import CLASSIFIER_DIRNAME, save_digit_classifier

    save_digit_classifier(video_classifier, {"input": "video"}, tmp_path / CLASSIFIER_DIRNAME)
    videos, labels, _ = rendered
    samples = [
        Sample(index=i, group_index=0, prompt="p", metadata={"label": k}, image=v)
        for i, (v, k) in enumerate(
            zip(videos[:4], [labels[0], labels[1], (labels[2] + 1) % 10, labels[3]], strict=True)
        )
    ]
    rewards = asyncio.run(batched_async_rm(_args(rm_type="digit", hf_checkpoint=str(tmp_path)), samples))
    on_grid = [torch.round(s.image.clamp(0, 1) * 255) / 255 for s in samples]  # the dispatch reads 8-bit pixels
    expected = digit_reward(on_grid, [s.metadata["label"] for s in samples], video_classifier)
    assert rewards == pytest.approx(expected, abs=1e-6)
    assert rewards[0] > 0.9 and rewards[2] < 0.1


def test_pickscore_on_a_video_sample_averages_evenly_spaced_frames(tiny_clip):
    from miles.rewards.scorers.pickscore import pickscore_reward

    model_dir, processor_dir = tiny_clip
    gen = torch.Generator().manual_seed(0)
    video = torch.rand(3, 5, 32, 32, generator=gen)  # the sample layout [3, F, H, W]
    image = torch.rand(3, 32, 32, generator=gen)
    prompt = "a photo of a cat"
    per_frame = pickscore_reward([video[:, f] for f in range(5)], [prompt] * 5, model_dir, processor_dir)
    assert len(set(per_frame)) == 5  # the frames score differently
    image_score = pickscore_reward([image], [prompt], model_dir, processor_dir)[0]

    def score(num_frames):
        args = _args(
            rm_type="pickscore",
            pickscore_model_path=model_dir,
            pickscore_processor_path=processor_dir,
            pickscore_num_frames=num_frames,
        )
        samples = [Sample(0, 0, prompt, image=video), Sample(1, 0, prompt, image=image)]
        return asyncio.run(batched_async_rm(args, samples))

    every, three, one = score(None), score(3), score(1)
    assert every[0] == pytest.approx(float(np.mean(per_frame)), abs=1e-5)
    assert three[0] == pytest.approx((per_frame[0] + per_frame[2] + per_frame[4]) / 3, abs=1e-5)
    assert one[0] == pytest.approx(per_frame[0], abs=1e-5)
    for scores in (every, three, one):  # images unchanged (batched with other frames: float rounding only)
        assert scores[1] == pytest.approx(image_score, abs=1e-5)


def test_pickscore_num_frames_below_one_is_refused():
    with pytest.raises(ConfigError, match="--pickscore-num-frames must be at least 1"):
        RewardSettings.from_args(_args(pickscore_num_frames=0))
    assert RewardSettings.from_args(_args(pickscore_num_frames=4)).pickscore_num_frames == 4
    assert RewardSettings.from_args(_args()).pickscore_num_frames is None
