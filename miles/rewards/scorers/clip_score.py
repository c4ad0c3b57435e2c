"""The CLIP score reward: a CLIP model's text-image cosine similarity, clamped at 0 and scaled.

    score = scale * max(cos(image_emb, text_emb), 0)

with the projected embeddings of a transformers `CLIPModel` and its `CLIPProcessor`, both loaded from local
folders (`--clip-score-model-path`, e.g. a copy of `openai/clip-vit-large-patch14`; the processor from the same
folder unless `--clip-score-processor-path` names another). This is CLIPScore (Hessel et al. 2021, "CLIPScore: A
Reference-free Evaluation Metric for Image Captioning", arXiv 2104.08718: `w * max(cos, 0)`), written with the
weight w = 100 of torchmetrics' `CLIPScore` (the paper uses w = 2.5) and divided by 30 as flow_grpo does:

    scale = 100 / 30   (the default, `CLIP_SCORE_SCALE`)

flow_grpo's `clipscore` reward (`flow_grpo/clip_scorer.py`, added 2025-07-28) returns
`logits_per_image.diagonal() / 30`, i.e. `exp(logit_scale) * cos / 30` with openai/clip-vit-large-patch14, whose
`exp(logit_scale)` is exactly 100; so the default reproduces the reward flow_grpo trains with. A matching pair's
cosine is typically 0.2-0.35, so rewards land around 0.7-1.2, roughly [0, 1]. Differences from flow_grpo: the
constant 100 stands for the model's own `exp(logit_scale)` (the reward does not depend on the checkpoint's
temperature), the cosine is clamped at 0 as in CLIPScore (flow_grpo does not clamp; a CLIP cosine below 0 is rare),
and images go through the processor as uint8 like PickScore (flow_grpo resizes the float tensor; the two differ by
the rounding to 1/255). `--clip-score-scale 100` gives torchmetrics' CLIPScore, 2.5 the paper's.

Text is padded and truncated to the tokenizer's max length (77 for CLIP). Forwards run in chunks of `batch_size`
images under a lock. A video sample, (F, 3, H, W), is scored on `num_frames` uniformly spaced frames (all when None)
and the frame scores are averaged.

Also the plumbing the other CLIP-family scorers share (`aesthetic`, `hps`, `image_reward`, `vlm_judge`):
`sample_frames` (a sample's frames as uint8), `ChunkedFrameScorer` (frames -> locked, chunked forwards -> per-sample
means, on the scorer's device), `ClipModelScorer` (a frozen CLIP model and processor: CLIP score's and PickScore's)
and `clip_pixels` (open_clip's / OpenAI CLIP's eval transform, without torchvision).
"""

from __future__ import annotations

import functools
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from miles.rewards.scorers._model import model_scorer
from miles.rewards.scorers.jpeg import image_to_uint8

if TYPE_CHECKING:
    from miles.rewards.dispatch import RewardSettings, Scorer

CLIP_SCORE_WEIGHT = 100.0  # torchmetrics' CLIPScore weight (Hessel et al.'s w is 2.5)
CLIP_SCORE_DIVISOR = 30.0  # flow_grpo's clip_scorer.py: logits_per_image.diagonal() / 30
CLIP_SCORE_SCALE = CLIP_SCORE_WEIGHT / CLIP_SCORE_DIVISOR

# OpenAI CLIP's normalisation (open_clip's OPENAI_DATASET_MEAN / _STD), used by HPSv2 and ImageReward too
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


# ---- shared plumbing ---------------------------------------------------------------------------
def projected(output: Any) -> Any:
    """transformers 5 returns a ModelOutput whose pooler_output is the projected embedding; 4.x a tensor."""
    return output if hasattr(output, "norm") else output.pooler_output


def frame_indices(num_available: int, num_frames: int | None) -> list[int]:
    """`num_frames` uniformly spaced frame indices (all frames when None or when there are fewer)."""
    if num_frames is None or num_frames >= num_available:
        return list(range(num_available))
    return [round(float(x)) for x in np.linspace(0, num_available - 1, num_frames)]


def sample_frames(image: Any, num_frames: int | None) -> list[np.ndarray]:
    """One sample -> its frames as (H, W, 3) uint8: an image is one frame; a video (F, 3, H, W) gives `num_frames`
    uniformly spaced frames (all when None)."""
    shape = tuple(image.shape) if hasattr(image, "shape") else None
    if shape is not None and len(shape) == 4:  # video (F, C, H, W)
        return [image_to_uint8(image[i]) for i in frame_indices(shape[0], num_frames)]
    return [image_to_uint8(image)]


def clip_cosines(model: Any, processor: Any, device: Any, images: list[np.ndarray], prompts: list[str]) -> Any:
    """The cosine of each (uint8 image, prompt) pair's projected CLIP embeddings (norms clamped >= 1e-12), float32,
    text padded and truncated to the tokenizer's max length: what CLIP score and PickScore scale."""
    import torch
    from PIL import Image

    tokenizer = processor.tokenizer
    text = tokenizer(
        prompts, padding="max_length", truncation=True, max_length=tokenizer.model_max_length, return_tensors="pt"
    ).to(device)
    pixels = processor.image_processor(images=[Image.fromarray(im) for im in images], return_tensors="pt")
    pixels = pixels.pixel_values.to(device, dtype=model.dtype)
    with torch.no_grad():
        text_emb = projected(model.get_text_features(**text)).float()
        image_emb = projected(model.get_image_features(pixel_values=pixels)).float()
        text_emb = text_emb / text_emb.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        image_emb = image_emb / image_emb.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        return (text_emb * image_emb).sum(dim=-1)


def resolve_device(device: str | None) -> Any:
    import torch

    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def frozen_clip(model_path: str, processor_path: str | None, device: Any) -> tuple[Any, Any]:
    """(processor, model): a local CLIP folder in eval mode on `device`, no parameter requiring grad; the processor
    from `processor_path` (default: the model's folder)."""
    from transformers import CLIPModel, CLIPProcessor

    processor = CLIPProcessor.from_pretrained(str(processor_path or model_path))
    model = CLIPModel.from_pretrained(str(model_path)).eval().to(device)
    model.requires_grad_(False)
    return processor, model


class ChunkedFrameScorer:
    """Scores (image, prompt) pairs: every sample's frames are flattened, scored by `_score_chunk` in chunks of
    `batch_size` under a lock (one forward at a time per scorer), and averaged back per sample. Its models run on
    `self.device` (`device`, else CUDA when there is one)."""

    def __init__(self, batch_size: int = 8, num_frames: int | None = None, device: str | None = None) -> None:
        if int(batch_size) < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        if num_frames is not None and int(num_frames) < 1:
            raise ValueError(f"num_frames must be at least 1 (None scores every frame), got {num_frames}")
        self.batch_size = int(batch_size)
        self.num_frames = None if num_frames is None else int(num_frames)
        self._lock = threading.Lock()
        self.device = resolve_device(device)

    def _score_chunk(self, images: list[np.ndarray], prompts: list[str]) -> list[float]:
        """One forward: (H, W, 3) uint8 frames and their prompts -> one float each."""
        raise NotImplementedError

    def score(self, images: Sequence[Any], prompts: Sequence[str]) -> list[float]:
        if len(images) != len(prompts):
            raise ValueError(f"{len(images)} images but {len(prompts)} prompts")
        flat_images: list[np.ndarray] = []
        flat_prompts: list[str] = []
        owner: list[int] = []
        for i, (image, prompt) in enumerate(zip(images, prompts, strict=True)):
            frames = sample_frames(image, self.num_frames)
            flat_images += frames
            flat_prompts += [str(prompt)] * len(frames)
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


def resize_center_crop(image: np.ndarray, size: int) -> np.ndarray:
    """torchvision's `Resize(size, BICUBIC)` then `CenterCrop(size)` on a PIL image, without torchvision: the
    shorter side becomes `size` (the longer `int(size * long / short)`), PIL bicubic; then the centre crop (offsets
    `int(round((side - size) / 2))`). (H, W, 3) uint8 in and out."""
    from PIL import Image

    h, w = image.shape[:2]
    short, long = (w, h) if w <= h else (h, w)
    new_short, new_long = size, int(size * long / short)
    new_w, new_h = (new_short, new_long) if w <= h else (new_long, new_short)
    pil = Image.fromarray(image)
    if (new_w, new_h) != (w, h):
        pil = pil.resize((new_w, new_h), Image.BICUBIC)
    top = round((new_h - size) / 2.0)
    left = round((new_w - size) / 2.0)
    return np.asarray(pil.crop((left, top, left + size, top + size)), dtype=np.uint8)


def clip_pixels(
    images: Sequence[np.ndarray],
    size: int,
    mean: Sequence[float] = OPENAI_CLIP_MEAN,
    std: Sequence[float] = OPENAI_CLIP_STD,
) -> Any:
    """open_clip's / OpenAI CLIP's eval transform (Resize(size, bicubic), CenterCrop(size), ToTensor, Normalize)
    on (H, W, 3) uint8 frames -> a float32 tensor (N, 3, size, size)."""
    import torch

    batch = np.stack([resize_center_crop(im, size) for im in images]).astype(np.float32) / 255.0
    pixels = torch.from_numpy(batch).permute(0, 3, 1, 2)
    mean_t = torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1)
    std_t = torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1)
    return (pixels - mean_t) / std_t


def module_from_state_dict(build: Callable[[], Any], state: Mapping[str, Any]) -> Any:
    """The module `build()` makes, holding exactly `state` as float32: built on the meta device (no random init),
    loaded strictly with `assign`, then its non-persistent `position_ids` buffers (arange) rebuilt on the CPU. A
    missing or unexpected key raises (RuntimeError from `load_state_dict`)."""
    import torch

    with torch.device("meta"):
        module = build()
    state = {k: (v.float() if v.is_floating_point() else v) for k, v in state.items()}
    module.load_state_dict(state, strict=True, assign=True)
    for sub in module.modules():
        for name, buf in list(sub.named_buffers(recurse=False)):
            if not buf.is_meta:
                continue
            if name != "position_ids":
                raise RuntimeError(f"buffer {name!r} of {type(sub).__name__} is not in the checkpoint")
            setattr(sub, name, torch.arange(buf.shape[-1]).expand(tuple(buf.shape)).clone())
    return module


def load_state_dict(path: str, what: str) -> dict[str, Any]:
    """The state dict saved at `path`: a plain one, or one under "state_dict"; "module." prefixes dropped.
    ValueError naming `what` it should be when the file holds something else."""
    import torch

    state = torch.load(str(path), map_location="cpu", weights_only=True)
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise ValueError(f"{path}: expected {what}, got {type(state).__name__}")
    return {k.removeprefix("module."): v for k, v in state.items()}


def count_numbered(state: Mapping[str, Any], prefix: str, kind: str, source: str) -> int:
    """How many blocks `prefix0.`, `prefix1.`, ... the state dict holds; ValueError (naming the `kind` of block and
    the `source`) unless there are some, numbered from 0 without gaps."""
    pattern = re.compile(re.escape(prefix) + r"(\d+)\.")
    found = {int(m.group(1)) for k in state if (m := pattern.match(k))}
    if not found or found != set(range(len(found))):
        raise ValueError(f"expected {kind} {prefix}0.. in {source}, found {sorted(found) or 'none'}")
    return len(found)


class ClipModelScorer(ChunkedFrameScorer):
    """A frozen CLIP model and its processor (`frozen_clip`; the processor from the model's folder when
    `processor_path` is None), scoring from the cosines of (image, prompt) (`clip_cosines`)."""

    def __init__(
        self,
        model_path: str,
        processor_path: str | None,
        batch_size: int = 8,
        num_frames: int | None = None,
        device: str | None = None,
    ) -> None:
        super().__init__(batch_size, num_frames, device)
        self.processor, self.model = frozen_clip(model_path, processor_path, self.device)

    def cosines(self, images: list[np.ndarray], prompts: list[str]) -> Any:
        return clip_cosines(self.model, self.processor, self.device, images, prompts)


# ---- CLIP score --------------------------------------------------------------------------------
class ClipScoreScorer(ClipModelScorer):
    """A CLIP model and processor, scoring `scale * max(cos, 0)` per (image, prompt)."""

    def __init__(
        self,
        model_path: str,
        processor_path: str | None = None,
        scale: float = CLIP_SCORE_SCALE,
        batch_size: int = 8,
        num_frames: int | None = None,
        device: str | None = None,
    ) -> None:
        super().__init__(model_path, processor_path, batch_size, num_frames, device)
        self.scale = float(scale)

    def _score_chunk(self, images: list[np.ndarray], prompts: list[str]) -> list[float]:
        return [float(s) for s in (self.scale * self.cosines(images, prompts).clamp_min(0.0)).cpu()]


@functools.lru_cache(maxsize=2)
def load_clip_score(
    model_path: str,
    processor_path: str | None = None,
    scale: float = CLIP_SCORE_SCALE,
    batch_size: int = 8,
    num_frames: int | None = None,
) -> ClipScoreScorer:
    """A process-wide CLIP-score scorer per (paths, scale, batch size, frames)."""
    return ClipScoreScorer(
        str(model_path),
        None if processor_path is None else str(processor_path),
        scale=float(scale),
        batch_size=int(batch_size),
        num_frames=num_frames,
    )


def build(settings: RewardSettings) -> Scorer:
    """`--rm-type clip_score`."""
    model = settings.get("clip_score_model_path")
    return model_scorer(
        load_clip_score(model, settings.get("clip_score_processor_path"), settings.get("clip_score_scale"))
    )
