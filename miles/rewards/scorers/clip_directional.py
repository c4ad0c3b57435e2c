"""CLIP directional similarity, the instruction reward of an edit (Gal et al. 2021, StyleGAN-NADA's directional
loss; InstructPix2Pix's `sim_direction`, `metrics/clip_similarity.py`): the edit's step in CLIP image space points
the way the captions' step points in CLIP text space.

    clip_directional = cos(E_I(edited) - E_I(source), E_T(target caption) - E_T(source caption))    in [-1, 1]

with `E_I`, `E_T` the unit-normalised projected embeddings of the CLIP of `--clip-score-model-path` (the one
`clip_i` loads, shared in a process; texts padded and truncated to 77 tokens). The captions come from the prompt
row's metadata: `metadata.target_caption` (what the edited image shows) and `metadata.source_caption` (what the
source shows), as InstructPix2Pix's evaluation data carries them. Without them the instruction itself is the target
text and the source caption is the empty string, so the text direction is E_T(instruction) - E_T(""): what the
instruction adds to CLIP's empty caption (cruder than captions; give captions when the data has them). A caption
given in metadata must be a string.

Swapping the captions flips the sign; an edit that returns the source has no image direction and scores 0, as do
equal captions (a step between the unit embeddings shorter than 1e-4 is float noise, not a direction). The source
is the row's first condition image; a video sample is scored on `--source-reward-num-frames` uniformly spaced frames
(all when unset), each against the source, averaged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from miles.rewards.scorers._source import paired_frames, per_sample_mean, sourced_scorer, unit
from miles.rewards.scorers.clip_i import ClipEmbedder, clip_embedder

if TYPE_CHECKING:
    from miles.rewards.dispatch import RewardSettings, Scorer

TARGET_CAPTION = "target_caption"
SOURCE_CAPTION = "source_caption"
MIN_STEP = 1e-4  # a step between unit embeddings shorter than this is float noise: no direction


def _caption(meta: Mapping[str, Any], key: str, default: str) -> str:
    value = meta.get(key)
    if value is None:
        return default
    if not isinstance(value, str):
        raise ValueError(f"metadata.{key} must be a string (a caption), got {type(value).__name__}")
    return value


def captions(prompt: str, meta: Mapping[str, Any]) -> tuple[str, str]:
    """(source caption, target caption) of one row: metadata's, else ("", the prompt)."""
    return _caption(meta, SOURCE_CAPTION, ""), _caption(meta, TARGET_CAPTION, prompt)


def directional_similarity(
    embedder: ClipEmbedder,
    images: Sequence[Any],
    sources: Sequence[Sequence[Any]],
    prompts: Sequence[str],
    metadata: Sequence[Mapping[str, Any]],
) -> list[float]:
    """cos(E_I(y) - E_I(x), E_T(target) - E_T(source caption)) per sample (a video's: the mean over its frames);
    `images` frames first."""
    pairs = [captions(p, m) for p, m in zip(prompts, metadata, strict=True)]
    frames, source_frames, owner = paired_frames(images, sources, embedder.num_frames)
    if not frames:
        return []
    image_step = embedder.embed(frames) - embedder.embed_distinct(source_frames)[owner]
    texts = embedder.embed_texts([c for pair in pairs for c in pair])  # source, target of each sample in turn
    text_step = texts[1::2] - texts[0::2]
    cos = (unit(image_step) * unit(text_step)[owner]).sum(-1)
    # no step (the output is the source, or the captions are equal, up to float noise): no direction, 0
    still = (image_step.norm(dim=-1) < MIN_STEP) | (text_step.norm(dim=-1)[owner] < MIN_STEP)
    cos = cos.masked_fill(still, 0.0)
    return per_sample_mean(cos.numpy(), owner, len(images))


def build(settings: RewardSettings) -> Scorer:
    """`--rm-type clip_directional`."""
    embedder = clip_embedder(settings)

    def score(
        images: list[Any], prompts: list[str], metadata: list[Mapping[str, Any]], sources: list[list[Any]]
    ) -> list[float]:
        return directional_similarity(embedder, images, sources, prompts, metadata)

    return sourced_scorer(score, "clip_directional", embedder.device)
