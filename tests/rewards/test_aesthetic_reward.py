"""The LAION aesthetic reward (`scorers.aesthetic`): the session's tiny random CLIP plus a random MLP head saved by
the test with `torch.save` in the published `sac+logos+ava1-l14-linearMSE.pth` layout (`layers.{0,2,4,6,7}.*`,
input width = the CLIP projection width), checked against `MLP(e / ||e||)` computed by hand."""

from __future__ import annotations

import asyncio
import shutil
from itertools import pairwise
from pathlib import Path

import pytest
import torch
from reward_helpers import linear, noise_image, normalized, random_tensors, to_uint8

from miles.config.resolution import schema_args
from miles.core.sample import Sample
from miles.rewards.dispatch import batched_async_rm
from miles.rewards.scorers.aesthetic import load_aesthetic

HIDDEN = (1024, 128, 64, 16, 1)


def head_shapes(width: int) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    sizes = (width, *HIDDEN)
    for index, (fan_in, fan_out) in zip((0, 2, 4, 6, 7), pairwise(sizes), strict=True):
        shapes[f"layers.{index}.weight"] = (fan_out, fan_in)
        shapes[f"layers.{index}.bias"] = (fan_out,)
    return shapes


@pytest.fixture(scope="module")
def aesthetic_head(tiny_clip, tmp_path_factory) -> tuple[str, dict[str, torch.Tensor]]:
    """A random head for the tiny CLIP (projection width 16) saved as a .pth; -> (path, state dict)."""
    from transformers import CLIPConfig

    width = CLIPConfig.from_pretrained(tiny_clip[0]).projection_dim
    state = random_tensors(head_shapes(width), seed=3, scale=0.15)
    path = tmp_path_factory.mktemp("aesthetic") / "sac+logos+ava1-l14-linearMSE.pth"
    torch.save(state, path)
    return str(path), state


def hand_aesthetic(clip_dir: str, processor_dir: str, state: dict, images: list[torch.Tensor]) -> list[float]:
    from PIL import Image
    from transformers import CLIPModel, CLIPProcessor

    model = CLIPModel.from_pretrained(clip_dir).eval()
    processor = CLIPProcessor.from_pretrained(processor_dir)
    pixels = processor.image_processor(
        images=[Image.fromarray(to_uint8(im)) for im in images], return_tensors="pt"
    ).pixel_values
    with torch.no_grad():
        x = normalized(model.vision_model(pixel_values=pixels).pooler_output @ model.visual_projection.weight.T)
        for index in (0, 2, 4, 6, 7):  # no activations: the published head is affine
            x = linear(x, state[f"layers.{index}.weight"], state[f"layers.{index}.bias"])
    return x.squeeze(-1).tolist()


@pytest.fixture(scope="module")
def clip_with_processor(tiny_clip, tmp_path_factory) -> str:
    """The tiny CLIP and its processor in one folder, as openai/clip-vit-large-patch14 ships them."""
    folder = tmp_path_factory.mktemp("aesthetic_clip") / "clip"
    shutil.copytree(tiny_clip[0], folder)
    for item in Path(tiny_clip[1]).iterdir():
        shutil.copy(item, folder / item.name)
    return str(folder)


@pytest.mark.slow
def test_aesthetic_tiny_random_weights(tiny_clip, aesthetic_head, clip_with_processor):
    head_path, state = aesthetic_head
    images = [noise_image(20 + i, 40, 48) for i in range(5)]
    expected = hand_aesthetic(tiny_clip[0], tiny_clip[1], state, images)

    scorer = load_aesthetic(head_path, clip_with_processor, batch_size=2)
    scores = scorer.score(images, ["ignored"] * 5)
    assert scores == pytest.approx(expected, abs=1e-5)
    assert len(set(scores)) == 5
    # a video: the mean of its frames' scores
    (video,) = scorer.score([torch.stack(images[:3])], ["ignored"])
    assert video == pytest.approx(sum(expected[:3]) / 3, abs=1e-5)


@pytest.mark.slow
def test_aesthetic_refuses_a_head_of_another_width(clip_with_processor, tmp_path):
    path = tmp_path / "wide.pth"
    torch.save({"state_dict": random_tensors(head_shapes(768), seed=0)}, path)  # ViT-L/14's head, tiny CLIP
    with pytest.raises(ValueError, match=r"width 16 .*layers\.0\.weight of shape \(1024, 768\)"):
        load_aesthetic(str(path), clip_with_processor)


@pytest.mark.slow
def test_aesthetic_flags_reach_the_dispatch_tiny_random_weights(
    tiny_clip, aesthetic_head, clip_with_processor, tmp_path
):
    """A job's --aesthetic-model-path (the MLP head) and --aesthetic-clip-path (CLIP and its processor): the dispatch
    scores with the models they name, as `load_aesthetic` with the same paths does; another head, other scores."""
    head_path, state = aesthetic_head
    images = [noise_image(70 + i, 40, 48) for i in range(3)]
    samples = [Sample(index=i, group_index=0, prompt=f"a photo {i}", image=im) for i, im in enumerate(images)]
    args = schema_args(rm_type=["aesthetic"], aesthetic_model_path=head_path, aesthetic_clip_path=clip_with_processor)
    got = asyncio.run(batched_async_rm(args, samples))
    assert got == load_aesthetic(head_path, clip_with_processor).score(images, [s.prompt for s in samples])
    assert got == pytest.approx(hand_aesthetic(tiny_clip[0], tiny_clip[1], state, images), abs=1e-5)

    other_state = random_tensors(head_shapes(len(state["layers.0.weight"][0])), seed=4, scale=0.15)
    other_head = tmp_path / "other.pth"
    torch.save(other_state, other_head)
    other = schema_args(
        rm_type=["aesthetic"], aesthetic_model_path=str(other_head), aesthetic_clip_path=clip_with_processor
    )
    moved = asyncio.run(batched_async_rm(other, samples))
    assert moved == pytest.approx(hand_aesthetic(tiny_clip[0], tiny_clip[1], other_state, images), abs=1e-5)
    assert all(a != pytest.approx(b, abs=1e-4) for a, b in zip(moved, got, strict=True))
