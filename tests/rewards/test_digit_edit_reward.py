"""The digit edit reward (`digit_edit`: "change the digit a into b, keeping its place and size") on real digits of
the embedded data set (the test split), each drawn 32 px wide on a 64-px canvas unless said, scored with the
classifier stored with tiny-sd3: `p_b(crop(y)) * place * size`."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from miles.config.resolution import schema_args
from miles.core.sample import Sample
from miles.data.digits import upsample_digits
from miles.rewards.dispatch import batched_async_rm
from miles.rewards.errors import RewardError
from miles.rewards.scorers.digit_edit import PLACE_SIGMA, crop_digit, edit_terms, gray, ink_centre

PLACE = (16, 20)  # the source digit's top-left corner on the canvas


def canvas(x8: np.ndarray, top: int, left: int, size: int = 64, digit: int = 32) -> torch.Tensor:
    """One 8x8 digit drawn `digit` px wide at (top, left) on a black canvas: [3, size, size] in [0, 1]."""
    image = np.zeros((size, size), dtype=np.float32)
    image[top : top + digit, left : left + digit] = upsample_digits(np.asarray(x8)[None], digit)[0]
    return torch.from_numpy(image)[None].expand(3, -1, -1).clone()


@pytest.fixture(scope="module")
def digit_of(digits_split):
    """digit -> the first 8x8 example of it in the test split."""
    x8, y = digits_split.test_x, digits_split.test_y
    return {d: x8[int(np.nonzero(y == d)[0][0])] for d in range(10)}


@pytest.mark.slow  # the session's tiny-sd3 build (a minute or two cold): not in the fast tier
def test_the_four_edits_of_a_three_into_a_five(digit_of, digit_classifier) -> None:
    """(a) the source itself: kept perfectly, but the classifier reads a 3: low; (b) a 5 drawn in its place: high;
    (c) the same 5 moved to a corner: still a 5, its place lost: low; (d) a wrong digit in the right place: low."""
    source = canvas(digit_of[3], *PLACE)
    right = canvas(digit_of[5], *PLACE)
    edits = {
        "same": source.clone(),
        "right": right,
        "corner": canvas(digit_of[5], 0, 0),
        "wrong": canvas(digit_of[8], *PLACE),
    }
    terms = dict(zip(edits, edit_terms(list(edits.values()), [source] * 4, [5] * 4, digit_classifier), strict=True))
    same, good, corner, wrong = (terms[k] for k in ("same", "right", "corner", "wrong"))

    assert (same.place, same.size, same.offset) == (1.0, 1.0, 0.0) and same.reward == same.p_label < 0.05
    assert good.p_label > 0.9 and good.place > 0.8 and good.size > 0.9 and good.reward > 0.75
    assert corner.p_label > 0.9 and corner.place < 0.01 and corner.reward < 0.01
    assert wrong.p_label < 0.05 and wrong.reward < 0.05
    for t in terms.values():
        assert 0.0 <= t.reward <= 1.0 and t.reward == pytest.approx(t.p_label * t.place * t.size)


@pytest.mark.slow  # the session's tiny-sd3 build (a minute or two cold): not in the fast tier
def test_every_pair_of_digits_ranks_the_right_edit_first(digit_of, digit_classifier) -> None:
    """Over all 90 ordered pairs (a, b): the right edit beats the source, the moved digit and a wrong digit."""
    rewards = {"same": [], "right": [], "corner": [], "wrong": []}
    for a in range(10):
        for b in range(10):
            if a == b:
                continue
            wrong = next(d for d in ((b + 1) % 10, (b + 2) % 10) if d != a)
            source = canvas(digit_of[a], *PLACE)
            edits = [source, canvas(digit_of[b], *PLACE), canvas(digit_of[b], 32, 32), canvas(digit_of[wrong], *PLACE)]
            for name, t in zip(rewards, edit_terms(edits, [source] * 4, [b] * 4, digit_classifier), strict=True):
                rewards[name].append(t.reward)
    right = np.array(rewards["right"])
    assert np.median(right) > 0.75 and right.min() > 0.5
    for other, ceiling in (("same", 0.05), ("corner", 0.1), ("wrong", 0.05)):  # corner: moved 16 px diagonally
        assert (right > np.array(rewards[other])).all(), other
        assert max(rewards[other]) < ceiling, other


@pytest.mark.slow  # the session's tiny-sd3 build (a minute or two cold): not in the fast tier
def test_the_terms_read_place_size_and_resolution(digit_of, digit_classifier) -> None:
    g = gray(canvas(digit_of[0], *PLACE))
    row, col = ink_centre(g)
    assert abs(row - (PLACE[0] + 15.5)) < 3 and abs(col - (PLACE[1] + 15.5)) < 3
    assert crop_digit(g).shape == (8, 8)
    assert np.allclose(ink_centre(np.zeros((64, 64), np.float32)), (31.5, 31.5))  # blank: the frame's centre
    assert PLACE_SIGMA == 1 / 4  # of the source digit's side: 8 px for a 32-px digit
    # the same edit at twice the resolution keeps its place and size (fractions of the frame)
    source = canvas(digit_of[3], *PLACE)
    big = torch.nn.functional.interpolate(canvas(digit_of[5], *PLACE)[None], scale_factor=2, mode="nearest")[0]
    small_t, big_t = edit_terms([canvas(digit_of[5], *PLACE), big], [source, source], [5, 5], digit_classifier)
    assert big_t.place == pytest.approx(small_t.place, abs=0.02)
    assert big_t.size == pytest.approx(small_t.size, abs=0.02)
    assert big_t.p_label > 0.9
    # the 5 drawn half as big in the same square's corner: still a 5 to the classifier's crop, its size lost
    (half,) = edit_terms([canvas(digit_of[5], *PLACE, digit=16)], [source], [5], digit_classifier)
    assert half.size == pytest.approx(0.5, abs=0.05) and half.reward < 0.5 * good_reward(digit_of, digit_classifier)


def good_reward(digit_of, classifier) -> float:
    source = canvas(digit_of[3], *PLACE)
    return edit_terms([canvas(digit_of[5], *PLACE)], [source], [5], classifier)[0].reward


@pytest.mark.slow  # the session's tiny-sd3 build (a minute or two cold): not in the fast tier
def test_the_crop_follows_the_source_digit_size(digit_of, digit_classifier) -> None:
    """A 48-px digit on the 64-px canvas: the classifier reads a crop of the source's size (half the frame would
    cut the digit), and sigma grows with it (a quarter of the source's side)."""
    source = canvas(digit_of[3], 8, 4, digit=48)
    right, moved = canvas(digit_of[5], 8, 4, digit=48), canvas(digit_of[5], 16, 16, digit=48)
    good, shifted = edit_terms([right, moved], [source, source], [5, 5], digit_classifier)
    assert good.p_label > 0.9 and good.size > 0.95 and good.place > 0.85 and good.reward > 0.8
    # moved 8 and 12 px (0.3 of the 48-px digit; the two digits' ink boxes differ too): the place is lost in part
    assert 0.15 < shifted.offset < 0.4 and 0.3 < shifted.place < 0.8 and shifted.reward < 0.8 * good.reward


@pytest.mark.slow  # the session's tiny-sd3 build (a minute or two cold): not in the fast tier
def test_digit_edit_through_the_dispatch(tiny_sd3_dir, digit_of, digit_classifier) -> None:
    """`--rm-type digit_edit`: the classifier of --hf-checkpoint, metadata.label the target, the sample's first
    condition image the source (a second one is not read); a video sample is refused in one line."""
    args = schema_args(rm_type=["digit_edit"], hf_checkpoint=str(tiny_sd3_dir))
    source = canvas(digit_of[3], *PLACE)
    edited = [canvas(digit_of[5], *PLACE), canvas(digit_of[5], 0, 0)]
    samples = [
        Sample(
            index=i,
            group_index=0,
            prompt="change the 3 into a 5",
            metadata={"label": 5, "source_label": 3},
            image=im,
            sources=[source, torch.zeros(3, 64, 64)],
        )
        for i, im in enumerate(edited)
    ]
    got = asyncio.run(batched_async_rm(args, samples))
    expected = [t.reward for t in edit_terms(edited, [source] * 2, [5, 5], digit_classifier)]
    assert got == pytest.approx(expected, abs=1e-12) and got[0] > 0.6 > got[1]

    video = torch.stack([edited[0]] * 3, dim=1)  # [3, F, H, W]
    samples[0].image = video
    with pytest.raises(RewardError, match=r"digit_edit scores an image edit, got a video of 3 frames"):
        asyncio.run(batched_async_rm(args, samples[:1]))
    samples[1].metadata = {"source_label": 3}
    with pytest.raises(RewardError, match=r"sample 1 .*metadata\.label"):
        asyncio.run(batched_async_rm(args, samples[1:]))


@pytest.mark.slow  # the session's tiny-sd3 build (a minute or two cold): not in the fast tier
def test_an_edits_eval_accuracy_reads_the_reward_crop(digit_of, digit_classifier) -> None:
    """`miles eval`'s digit `accuracy` of an edit reads the digit where `digit_edit` reads it (the crop at the source
    digit's size around the output's ink): every right edit of the 90 pairs counts, every copied source does not.
    The whole canvas, which the classifier was not fitted to for a digit pasted at an offset, reads fewer right."""
    from miles.rewards.scorers.digit_metrics import digit_eval_metrics

    pairs = [(a, b) for a in range(10) for b in range(10) if a != b]
    sources = [canvas(digit_of[a], 8, 4, digit=48) for a, _ in pairs]
    rights = [canvas(digit_of[b], 8, 4, digit=48) for _, b in pairs]
    meta = [{"label": b} for _, b in pairs]
    edit = digit_eval_metrics(rights, meta, digit_classifier, sources=sources)
    assert edit["accuracy"] >= 0.95 and "fd" in edit
    assert digit_eval_metrics(sources, meta, digit_classifier, sources=sources)["accuracy"] <= 0.05
    whole = digit_eval_metrics(rights, meta, digit_classifier)
    assert whole["accuracy"] < edit["accuracy"] - 0.2
