"""What the builds of the model scorers share: a model's `score(images, prompts)` as a dispatch scorer, and a video
sample frames first, the layout the model scorers read frames from."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from miles.rewards.dispatch import Scorer


def frames_first(image: Any) -> Any:
    """A video sample `[3, F, H, W]` -> `[F, 3, H, W]`, the layout the PickScore scorer reads frames from (it
    scores `--pickscore-num-frames` evenly spaced frames and averages them); images pass through."""
    shape = getattr(image, "shape", ())
    if len(shape) != 4:
        return image
    return image.permute(1, 0, 2, 3) if hasattr(image, "permute") else image.transpose(1, 0, 2, 3)


def model_scorer(model: Any) -> Scorer:
    """The model's `score(images, prompts)` as a dispatch scorer; a video sample `[3, F, H, W]` goes in frames
    first, the layout the model scorers read frames from."""

    def score(images: Sequence[Any], prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]) -> list[float]:
        return model.score([frames_first(im) for im in images], list(prompts))

    score.device = getattr(model, "device", "cpu")  # type: ignore[attr-defined]
    return score
