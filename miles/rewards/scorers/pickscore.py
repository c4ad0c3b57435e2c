"""The PickScore reward: CLIP text-image alignment, scaled to roughly [0, 1].

    score = exp(logit_scale) * dot(text_emb, image_emb) / 26.0

with L2-normalized (norm clamped >= 1e-12) projected embeddings of `CLIPModel` (transformers),
loaded from `--pickscore-model-path` (e.g. `yuvalkirstain/PickScore_v1`) with its `CLIPProcessor`
from `--pickscore-processor-path` (e.g. `laion/CLIP-ViT-H-14-laion2B-s32B-b79K`). The /26 maps raw
PickScore logits (~0-26) to roughly 0-1 (flow_grpo's `pickscore_scorer.py`). Text is padded and
truncated to the tokenizer's max length (77 for CLIP). Forwards run in chunks of `batch_size`
images (`--pickscore-batch-size`).

Images are converted to uint8 RGB like flow_grpo (x 255, rounded; see `jpeg.image_to_uint8`). A video
sample, (F, 3, H, W), is scored on `num_frames` uniformly spaced frames (all when None) and the frame
scores are averaged (`--pickscore-num-frames`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from miles.rewards.scorers._model import frames_first
from miles.rewards.scorers.clip_score import (
    ClipModelScorer,
    frame_indices,
)

if TYPE_CHECKING:
    from miles.rewards.dispatch import RewardSettings, Scorer

__all__ = ["PickScoreScorer", "build", "frame_indices", "load_pickscore", "pickscore_reward"]

PICKSCORE_SCALE = 26.0


class PickScoreScorer(ClipModelScorer):
    """A CLIP model and processor, scoring (image, prompt) pairs: frames flattened, forwards in chunks of
    `batch_size` under a lock, averaged back per sample (`ChunkedFrameScorer`)."""

    def _score_chunk(self, images: list[np.ndarray], prompts: list[str]) -> list[float]:
        scores = self.model.logit_scale.float().exp() * self.cosines(images, prompts) / PICKSCORE_SCALE
        return [float(s) for s in scores.cpu()]


@functools.lru_cache(maxsize=2)
def load_pickscore(
    model_path: str, processor_path: str, batch_size: int = 8, num_frames: int | None = None
) -> PickScoreScorer:
    """A process-wide PickScore scorer per (paths, batch size, frames)."""
    return PickScoreScorer(model_path, processor_path, batch_size=batch_size, num_frames=num_frames)


def pickscore_reward(
    images: Sequence[Any],
    prompts: Sequence[str],
    model_path: str,
    processor_path: str,
    batch_size: int = 8,
    num_frames: int | None = None,
) -> list[float]:
    """One PickScore per (image, prompt)."""
    return load_pickscore(str(model_path), str(processor_path), int(batch_size), num_frames).score(images, prompts)


def build(settings: RewardSettings) -> Scorer:
    """`--rm-type pickscore`; a video sample is read frames first (`frames_first`)."""
    scorer = load_pickscore(
        settings.pickscore_model_path,
        settings.pickscore_processor_path,
        settings.pickscore_batch_size,
        settings.pickscore_num_frames,
    )
    return lambda images, prompts, metadata: scorer.score([frames_first(im) for im in images], prompts)
