"""The LAION aesthetic score (improved aesthetic predictor v2, `sac+logos+ava1-l14-linearMSE.pth`).

    e     = get_image_features(image) / ||get_image_features(image)||     (CLIP ViT-L/14, L2-normalised)
    score = MLP(e),  MLP = Linear(d, 1024) Dropout(0.2) Linear(1024, 128) Dropout(0.2) Linear(128, 64)
                           Dropout(0.1) Linear(64, 16) Linear(16, 1)

Source: christophschuhmann/improved-aesthetic-predictor (`simple_inference.py`: the `MLP` module, its ReLUs
commented out, so the head is one affine map; the dropouts are off at eval), as flow_grpo's `aesthetic` reward runs
it (`flow_grpo/aesthetic_scorer.py`: `CLIPModel.get_image_features` of openai/clip-vit-large-patch14 on the
processor's pixels, divided by its L2 norm, then the MLP; the .pth ships in `flow_grpo/assets`). The state dict's
keys are those of the `nn.Sequential` named `layers`: `layers.{0,2,4,6,7}.{weight,bias}` (1, 3, 5 are dropouts).

The score is the raw predictor output, the LAION 1-10 rating scale (typical generations score 5-6.5); flow_grpo
trains on it unscaled, and so does this reward. d is the CLIP config's `projection_dim` (768 for ViT-L/14), so a
tiny CLIP works with a .pth of the same input width.

The CLIP model and its `CLIPProcessor` load from one local folder (`--aesthetic-clip-path`, a copy of
openai/clip-vit-large-patch14), the MLP from `--aesthetic-model-path`. Images are converted to uint8 RGB like flow_grpo
(x 255, rounded). Forwards run in chunks of `batch_size` images under a lock; a video sample, (F, 3, H, W), is
scored on `num_frames` uniformly spaced frames (all when None) and the frame scores are averaged.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import numpy as np

from miles.rewards.scorers._model import model_scorer
from miles.rewards.scorers.clip_score import ChunkedFrameScorer, frozen_clip, load_state_dict, projected

if TYPE_CHECKING:
    from miles.rewards.dispatch import RewardSettings, Scorer

MLP_HIDDEN = (1024, 128, 64, 16)
MLP_DROPOUT = (0.2, 0.2, 0.1)


def aesthetic_mlp(input_size: int) -> Any:
    """The predictor head: a module whose `layers` = Linear, Dropout, Linear, Dropout, Linear, Dropout, Linear,
    Linear (so its state dict keys are the published `layers.N.*`); call `head.layers(x)`."""
    from torch import nn

    h1, h2, h3, h4 = MLP_HIDDEN
    head = nn.Module()
    head.layers = nn.Sequential(
        nn.Linear(input_size, h1),
        nn.Dropout(MLP_DROPOUT[0]),
        nn.Linear(h1, h2),
        nn.Dropout(MLP_DROPOUT[1]),
        nn.Linear(h2, h3),
        nn.Dropout(MLP_DROPOUT[2]),
        nn.Linear(h3, h4),
        nn.Linear(h4, 1),
    )
    return head


class AestheticScorer(ChunkedFrameScorer):
    """A CLIP image tower and the aesthetic MLP, scoring images (prompts are ignored)."""

    def __init__(
        self,
        model_path: str,
        clip_path: str,
        batch_size: int = 8,
        num_frames: int | None = None,
        device: str | None = None,
    ) -> None:
        super().__init__(batch_size, num_frames, device)
        self.processor, self.clip = frozen_clip(clip_path, None, self.device)
        width = int(self.clip.config.projection_dim)
        state = load_state_dict(model_path, "a state dict")
        first = state.get("layers.0.weight")
        if first is None or tuple(first.shape)[1:] != (width,):
            got = "no layers.0.weight" if first is None else f"layers.0.weight of shape {tuple(first.shape)}"
            raise ValueError(
                f"{model_path}: the aesthetic MLP must take the CLIP embedding (width {width} from {clip_path}'s "
                f"projection_dim), got {got}"
            )
        self.mlp = aesthetic_mlp(width)
        self.mlp.load_state_dict(state, strict=True)
        self.mlp = self.mlp.eval().to(self.device)
        self.mlp.requires_grad_(False)

    def _score_chunk(self, images: list[np.ndarray], prompts: list[str]) -> list[float]:
        import torch
        from PIL import Image

        pixels = self.processor.image_processor(
            images=[Image.fromarray(im) for im in images], return_tensors="pt"
        ).pixel_values.to(self.device, dtype=self.clip.dtype)
        with torch.no_grad():
            emb = projected(self.clip.get_image_features(pixel_values=pixels)).float()
            emb = emb / torch.linalg.vector_norm(emb, dim=-1, keepdim=True).clamp_min(1e-12)
            scores = self.mlp.layers(emb).squeeze(-1)
        return [float(s) for s in scores.cpu()]


@functools.lru_cache(maxsize=2)
def load_aesthetic(
    model_path: str, clip_path: str, batch_size: int = 8, num_frames: int | None = None
) -> AestheticScorer:
    """A process-wide aesthetic scorer per (MLP path, CLIP path, batch size, frames)."""
    return AestheticScorer(str(model_path), str(clip_path), batch_size=int(batch_size), num_frames=num_frames)


def build(settings: RewardSettings) -> Scorer:
    """`--rm-type aesthetic`."""
    return model_scorer(load_aesthetic(settings.get("aesthetic_model_path"), settings.get("aesthetic_clip_path")))
