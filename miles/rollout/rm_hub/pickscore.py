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
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from miles.rollout.rm_hub.jpeg import image_to_uint8

PICKSCORE_SCALE = 26.0


def _projected(output: Any) -> Any:
    """transformers 5 returns a ModelOutput whose pooler_output is the projected embedding; 4.x a tensor."""
    return output if hasattr(output, "norm") else output.pooler_output


def frame_indices(num_available: int, num_frames: int | None) -> list[int]:
    """`num_frames` uniformly spaced frame indices (all frames when None or when there are fewer)."""
    if num_frames is None or num_frames >= num_available:
        return list(range(num_available))
    return [round(float(x)) for x in np.linspace(0, num_available - 1, num_frames)]


def _frames(image: Any, num_frames: int | None) -> list[np.ndarray]:
    shape = tuple(image.shape) if hasattr(image, "shape") else None
    if shape is not None and len(shape) == 4:  # video (F, C, H, W)
        return [image_to_uint8(image[i]) for i in frame_indices(shape[0], num_frames)]
    return [image_to_uint8(image)]


class PickScoreScorer:
    """A CLIP model and processor, scoring (image, prompt) pairs. Calls are serialized by a lock."""

    def __init__(
        self,
        model_path: str,
        processor_path: str,
        batch_size: int = 8,
        num_frames: int | None = None,
        device: str | None = None,
    ) -> None:
        import torch
        from transformers import CLIPModel, CLIPProcessor

        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.processor = CLIPProcessor.from_pretrained(str(processor_path))
        self.model = CLIPModel.from_pretrained(str(model_path)).eval().to(self.device)
        self.model.requires_grad_(False)
        self.batch_size = int(batch_size)
        self.num_frames = num_frames
        self._lock = threading.Lock()

    def _score_chunk(self, images: list[np.ndarray], prompts: list[str]) -> list[float]:
        import torch
        from PIL import Image

        tokenizer = self.processor.tokenizer
        text = tokenizer(
            prompts,
            padding="max_length",
            truncation=True,
            max_length=tokenizer.model_max_length,
            return_tensors="pt",
        ).to(self.device)
        pixels = self.processor.image_processor(
            images=[Image.fromarray(im) for im in images], return_tensors="pt"
        ).pixel_values.to(self.device, dtype=self.model.dtype)
        with torch.no_grad():
            text_emb = _projected(self.model.get_text_features(**text)).float()
            image_emb = _projected(self.model.get_image_features(pixel_values=pixels)).float()
            text_emb = text_emb / text_emb.norm(dim=-1, keepdim=True).clamp_min(1e-12)
            image_emb = image_emb / image_emb.norm(dim=-1, keepdim=True).clamp_min(1e-12)
            scores = self.model.logit_scale.float().exp() * (text_emb * image_emb).sum(dim=-1) / PICKSCORE_SCALE
        return [float(s) for s in scores.cpu()]

    def score(self, images: Sequence[Any], prompts: Sequence[str]) -> list[float]:
        if len(images) != len(prompts):
            raise ValueError(f"{len(images)} images but {len(prompts)} prompts")
        flat_images: list[np.ndarray] = []
        flat_prompts: list[str] = []
        owner: list[int] = []
        for i, (image, prompt) in enumerate(zip(images, prompts, strict=True)):
            frames = _frames(image, self.num_frames)
            flat_images += frames
            flat_prompts += [prompt] * len(frames)
            owner += [i] * len(frames)
        flat: list[float] = []
        with self._lock:
            for start in range(0, len(flat_images), self.batch_size):
                stop = start + self.batch_size
                flat += self._score_chunk(flat_images[start:stop], flat_prompts[start:stop])
        totals = np.zeros(len(images))
        counts = np.zeros(len(images))
        np.add.at(totals, owner, flat)
        np.add.at(counts, owner, 1)
        return [float(t / c) for t, c in zip(totals, counts, strict=True)]


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
