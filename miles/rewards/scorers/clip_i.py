"""CLIP-I, the image-preservation reward of an edit: how close the edited image stays to its source in CLIP's image
space (InstructPix2Pix's `sim_image`, `metrics/clip_similarity.py`; MagicBrush reports it against a ground truth,
here it is against the source, a preservation term).

    clip_i = cos(E_I(edited), E_I(source))        in [-1, 1]; 1 when the edit returns the source

with `E_I` the projected image embedding of a transformers `CLIPModel` read through its `CLIPProcessor` (uint8
frames, as `clip_score` reads them), both loaded from the local folder of `--clip-score-model-path` (the processor
from `--clip-score-processor-path` when separate): the same CLIP, loaded once per process, as `clip_directional`
(and the same folder as `clip_score`). The source is the prompt row's first condition image; a video sample is
scored on `--source-reward-num-frames` uniformly spaced frames (all when unset), each against the source, averaged
(for I2V: how far the video drifts from its first frame).

Alone it is maximised by copying the source: weigh it with a reward of the instruction (`clip_directional`,
`vlm_judge_edit`), e.g. `--reward-weights vlm_judge_edit=1,clip_i=0.2`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from miles.rewards.scorers._source import ImageEmbedder, sourced_scorer, unit
from miles.rewards.scorers.clip_score import frozen_clip, projected

if TYPE_CHECKING:
    from miles.rewards.dispatch import RewardSettings, Scorer


class ClipEmbedder(ImageEmbedder):
    """A frozen CLIP (`frozen_clip`): `embed` the images (projected image features), `embed_texts` the texts
    (projected text features, padded and truncated to the tokenizer's max length), both unit-norm float32."""

    def __init__(
        self,
        model_path: str,
        processor_path: str | None = None,
        batch_size: int = 8,
        num_frames: int | None = None,
        device: str | None = None,
    ) -> None:
        super().__init__(batch_size, num_frames, device)
        self.processor, self.model = frozen_clip(model_path, processor_path, self.device)

    def _embed_chunk(self, frames: list[np.ndarray]) -> Any:
        from PIL import Image

        pixels = self.processor.image_processor(images=[Image.fromarray(f) for f in frames], return_tensors="pt")
        pixels = pixels.pixel_values.to(self.device, dtype=self.model.dtype)
        return projected(self.model.get_image_features(pixel_values=pixels))

    def embed_texts(self, texts: Sequence[str]) -> Any:
        import torch

        tokenizer = self.processor.tokenizer
        parts = []
        with self._lock, torch.no_grad():
            for start in range(0, len(texts), self.batch_size):
                tokens = tokenizer(
                    list(texts[start : start + self.batch_size]),
                    padding="max_length",
                    truncation=True,
                    max_length=tokenizer.model_max_length,
                    return_tensors="pt",
                ).to(self.device)
                parts.append(projected(self.model.get_text_features(**tokens)).float().cpu())
        return unit(torch.cat(parts)) if parts else torch.zeros(0, 0)


@functools.lru_cache(maxsize=2)
def load_clip_embedder(
    model_path: str, processor_path: str | None = None, batch_size: int = 8, num_frames: int | None = None
) -> ClipEmbedder:
    """A process-wide CLIP embedder per (paths, batch size, frames): `clip_i` and `clip_directional` share it."""
    return ClipEmbedder(
        str(model_path), None if processor_path is None else str(processor_path), int(batch_size), num_frames
    )


def clip_embedder(settings: RewardSettings) -> ClipEmbedder:
    """The CLIP of `--clip-score-model-path` (and `--clip-score-processor-path`), `--source-reward-num-frames`."""
    return load_clip_embedder(
        settings.get("clip_score_model_path"),
        settings.get("clip_score_processor_path"),
        8,
        settings.get("source_reward_num_frames"),
    )


def build(settings: RewardSettings) -> Scorer:
    """`--rm-type clip_i`."""
    embedder = clip_embedder(settings)

    def score(
        images: list[Any], prompts: list[str], metadata: list[Mapping[str, Any]], sources: list[list[Any]]
    ) -> list[float]:
        return embedder.preservation(images, sources)

    return sourced_scorer(score, "clip_i", embedder.device)
