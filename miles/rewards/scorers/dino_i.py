"""DINO-I, the image-preservation reward of an edit in a self-supervised feature space (MagicBrush's DINO metric;
DINOv2 here, as in later edit benchmarks): DINO features track identity and layout more than CLIP's semantics do.

    dino_i = cos(CLS(edited), CLS(source))        in [-1, 1]; 1 when the edit returns the source

with `CLS` the class token of the last layer (after the final layer norm: `Dinov2Model`'s `pooler_output`) of a
transformers `Dinov2Model`, its images prepared by the image processor saved in the same folder (a BitImageProcessor
for facebook/dinov2-*: resize 256, centre crop 224, ImageNet mean/std), both from the local folder
`--dino-model-path` (e.g. a copy of facebook/dinov2-base). The source is the prompt row's first condition image; a
video sample is scored on `--source-reward-num-frames` uniformly spaced frames (all when unset), each against the
source, averaged.

Like `clip_i`, it is maximised by copying the source: pair it with a reward of the instruction.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from miles.rewards.scorers._source import ImageEmbedder, sourced_scorer

if TYPE_CHECKING:
    from miles.rewards.dispatch import RewardSettings, Scorer


class DinoEmbedder(ImageEmbedder):
    """A frozen `Dinov2Model` and its image processor from one local folder; embeddings are the last layer's CLS."""

    def __init__(
        self, model_path: str, batch_size: int = 8, num_frames: int | None = None, device: str | None = None
    ) -> None:
        from transformers import AutoImageProcessor, Dinov2Model

        super().__init__(batch_size, num_frames, device)
        self.processor = AutoImageProcessor.from_pretrained(str(model_path))
        self.model = Dinov2Model.from_pretrained(str(model_path)).eval().to(self.device)
        self.model.requires_grad_(False)

    def _embed_chunk(self, frames: list[np.ndarray]) -> Any:
        from PIL import Image

        pixels = self.processor(images=[Image.fromarray(f) for f in frames], return_tensors="pt").pixel_values
        out = self.model(pixel_values=pixels.to(self.device, dtype=self.model.dtype))
        return out.pooler_output  # the last layer's (layer-normed) CLS token


@functools.lru_cache(maxsize=2)
def load_dino_embedder(model_path: str, batch_size: int = 8, num_frames: int | None = None) -> DinoEmbedder:
    """A process-wide DINOv2 embedder per (folder, batch size, frames)."""
    return DinoEmbedder(str(model_path), int(batch_size), num_frames)


def build(settings: RewardSettings) -> Scorer:
    """`--rm-type dino_i`."""
    embedder = load_dino_embedder(settings.get("dino_model_path"), 8, settings.get("source_reward_num_frames"))

    def score(
        images: list[Any], prompts: list[str], metadata: list[Mapping[str, Any]], sources: list[list[Any]]
    ) -> list[float]:
        return embedder.preservation(images, sources)

    return sourced_scorer(score, "dino_i", embedder.device)
