"""What the rewards that score an edit against its source share (`needs` "source" in the reward table: `clip_i`,
`clip_directional`, `dino_i`, `vlm_judge_edit`, `digit_edit`).

The dispatch calls their scorers as `scorer(images, prompts, metadata, sources=...)`: per sample, the list of the
prompt row's condition images (`Sample.sources`, each `[3, H, W]` in [0, 1]). The embedding rewards compare the
output with the row's first condition image (`first_source`; the others, a multi-reference edit's extra images, are
not read). A video sample (`[3, F, H, W]`, an I2V output whose source is its first frame) is scored on `num_frames`
uniformly spaced frames (all when None), each against the source, and the frame scores are averaged, as
`ChunkedFrameScorer` averages a video's frames.

`ImageEmbedder` is the frozen image tower these rewards read: frames (uint8) in, unit-norm embeddings out, in chunks
of `batch_size` under a lock; `preservation` is its cosine between each frame and the source.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from miles.rewards.scorers._model import frames_first
from miles.rewards.scorers.clip_score import resolve_device, sample_frames
from miles.rewards.scorers.jpeg import image_to_uint8

if TYPE_CHECKING:
    from miles.rewards.dispatch import Scorer

# the scorer body: (images frames first, prompts, metadata, sources) -> one float per sample
SourcedScore = Callable[[list[Any], list[str], list[Mapping[str, Any]], list[list[Any]]], list[float]]


def first_sources(sources: Sequence[Sequence[Any]]) -> list[Any]:
    """Each sample's first condition image as it came (a tensor); ValueError when a sample has none."""
    out = []
    for per_sample in sources:
        if not per_sample:
            raise ValueError("no source image (the prompt row has no condition image)")
        out.append(per_sample[0])
    return out


def first_source(sources: Sequence[Any]) -> np.ndarray:
    """The first condition image of one sample as (H, W, 3) uint8; ValueError when there is none or it is not one
    image."""
    (source,) = first_sources([sources])
    if len(getattr(source, "shape", ())) == 4:
        raise ValueError(
            f"the source must be one image [3, H, W], got shape {tuple(source.shape)} (a video condition is not read)"
        )
    return image_to_uint8(source)


def is_video(image: Any) -> bool:
    """A video sample, frames first (F, 3, H, W)."""
    return len(getattr(image, "shape", ())) == 4


def paired_frames(
    images: Sequence[Any], sources: Sequence[Sequence[Any]], num_frames: int | None
) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray]:
    """(every sample's frames as uint8, one source per sample as uint8, each frame's sample index); `images` frames
    first (an image is one frame, a video gives `num_frames` uniformly spaced frames)."""
    if len(images) != len(sources):
        raise ValueError(f"{len(images)} images but {len(sources)} source lists")
    frames: list[np.ndarray] = []
    owner: list[int] = []
    for i, image in enumerate(images):
        per_sample = sample_frames(image, num_frames)
        frames += per_sample
        owner += [i] * len(per_sample)
    return frames, [first_source(s) for s in sources], np.asarray(owner, dtype=np.int64)


def per_sample_mean(values: Any, owner: np.ndarray, n: int) -> list[float]:
    """The mean of each sample's values (`owner[k]`: the sample value k belongs to)."""
    values = np.asarray(values, dtype=np.float64)
    totals = np.bincount(owner, weights=values, minlength=n)
    counts = np.bincount(owner, minlength=n)
    return [float(t / c) for t, c in zip(totals, np.maximum(counts, 1), strict=True)]


class ImageEmbedder:
    """A frozen image tower: `embed(frames)` -> (N, D) float32 unit-norm embeddings on the CPU, forwards in chunks of
    `batch_size` under a lock (one at a time per embedder), on `self.device` (`device`, else CUDA when there is
    one)."""

    def __init__(self, batch_size: int = 8, num_frames: int | None = None, device: str | None = None) -> None:
        if int(batch_size) < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        if num_frames is not None and int(num_frames) < 1:
            raise ValueError(f"num_frames must be at least 1 (None scores every frame), got {num_frames}")
        self.batch_size = int(batch_size)
        self.num_frames = None if num_frames is None else int(num_frames)
        self.device = resolve_device(device)
        self._lock = threading.Lock()

    def _embed_chunk(self, frames: list[np.ndarray]) -> Any:
        """One forward: (H, W, 3) uint8 frames -> (n, D) float embeddings (any norm)."""
        raise NotImplementedError

    def embed(self, frames: Sequence[np.ndarray]) -> Any:
        import torch

        parts = []
        with self._lock, torch.no_grad():
            for start in range(0, len(frames), self.batch_size):
                parts.append(self._embed_chunk(list(frames[start : start + self.batch_size])).float().cpu())
        if not parts:
            return torch.zeros(0, 0)
        return unit(torch.cat(parts))

    def embed_distinct(self, frames: Sequence[np.ndarray]) -> Any:
        """`embed`, each distinct frame forwarded once (a prompt group's samples share their source)."""
        keys: dict[tuple[tuple[int, ...], bytes], int] = {}
        index = [keys.setdefault((f.shape, f.tobytes()), len(keys)) for f in frames]
        distinct = [None] * len(keys)
        for f, k in zip(frames, index, strict=True):
            distinct[k] = f
        return self.embed(distinct)[index]

    def preservation(self, images: Sequence[Any], sources: Sequence[Sequence[Any]]) -> list[float]:
        """cos(E(frame), E(source)) per sample (a video's: the mean over its frames); `images` frames first."""
        frames, source_frames, owner = paired_frames(images, sources, self.num_frames)
        if not frames:
            return []
        emb, src = self.embed(frames), self.embed_distinct(source_frames)
        cos = (emb * src[owner]).sum(-1)
        return per_sample_mean(cos.numpy(), owner, len(images))


def unit(x: Any) -> Any:
    """Rows scaled to unit norm (norms clamped at 1e-12: a zero row stays zero)."""
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)


def sourced_scorer(score: SourcedScore, rm_type: str, device: Any = "cpu") -> Scorer:
    """`score` as a dispatch scorer of a sourced type: `scorer(images, prompts, metadata, sources=...)`, a video
    sample `[3, F, H, W]` handed over frames first. Called without `sources` it raises (a TypeError naming the
    type): a sourced type is never scored on images alone."""

    def scorer(
        images: Sequence[Any],
        prompts: Sequence[str],
        metadata: Sequence[Mapping[str, Any]],
        sources: Sequence[Sequence[Any]] | None = None,
    ) -> list[float]:
        if sources is None:
            raise TypeError(f"the {rm_type} scorer needs sources= (each sample's source images)")
        if not len(images) == len(prompts) == len(metadata) == len(sources):
            raise ValueError(
                f"{len(images)} images, {len(prompts)} prompts, {len(metadata)} metadata and {len(sources)} sources"
            )
        return score(
            [frames_first(im) for im in images], [str(p) for p in prompts], list(metadata), [list(s) for s in sources]
        )

    scorer.device = device  # type: ignore[attr-defined]
    return scorer
