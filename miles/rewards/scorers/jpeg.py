"""JPEG (in)compressibility rewards (DDPO, as flow_grpo implements them), plus the image conversion
every built-in reward shares.

    jpeg_incompressibility = size_kB            (JPEG, PIL, quality 95; kB = bytes / 1000)
    jpeg_compressibility   = -size_kB / 500

The /500 follows flow_grpo (`flow_grpo/rewards.py`) and the D.7.4 test relation
`jpeg_compressibility == -jpeg_incompressibility / 500`; DDPO's original `-size_kB` differs only by
that positive factor, so both rank images the same way. The /500 brings typical 512x512 sizes
(tens to hundreds of kB) to roughly [-1, 0].

Deterministic: the same pixels always give the same bytes (libjpeg, fixed quality, no metadata).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from miles.rewards.dispatch import RewardSettings, Scorer

JPEG_QUALITY = 95
COMPRESSIBILITY_SCALE = 500.0


def image_to_uint8(image: Any) -> np.ndarray:
    """One image -> (H, W, 3) uint8 RGB.

    Accepts a float tensor/array (3, H, W) or (H, W, 3) in [0, 1] (scaled by 255, rounded and clipped,
    like flow_grpo), a uint8 array in either layout, a 1-channel image (repeated to RGB), or a PIL image.
    """
    if hasattr(image, "convert") and hasattr(image, "size"):  # PIL.Image
        return np.asarray(image.convert("RGB"), dtype=np.uint8)
    if hasattr(image, "detach"):  # torch.Tensor, without importing torch
        image = image.detach().cpu()
        image = image.float().numpy() if image.is_floating_point() else image.numpy()
    arr = np.asarray(image)
    if arr.ndim == 2:
        arr = arr[..., None]
    if arr.ndim != 3:
        raise ValueError(f"expected one image (C, H, W) or (H, W, C), got shape {tuple(arr.shape)}")
    if arr.shape[0] in (1, 3) and arr.shape[-1] not in (1, 3):
        arr = arr.transpose(1, 2, 0)
    if arr.shape[-1] not in (1, 3):
        raise ValueError(f"expected 1 or 3 channels, got an image of shape {tuple(arr.shape)}")
    if arr.shape[-1] == 1:
        arr = np.repeat(arr, 3, axis=-1)
    if arr.dtype == np.uint8:
        return np.ascontiguousarray(arr)
    if not np.issubdtype(arr.dtype, np.number) or arr.dtype == np.bool_:
        raise ValueError(f"cannot read an image of dtype {arr.dtype}")
    arr = arr.astype(np.float32)
    if not np.isfinite(arr).all():
        raise ValueError("the image has NaN or infinite values")
    return np.ascontiguousarray(np.clip(np.round(arr * 255.0), 0, 255).astype(np.uint8))


def jpeg_size_kb(image: Any, quality: int = JPEG_QUALITY) -> float:
    """Size of the image as a JPEG at `quality`, in kB (bytes / 1000)."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(image_to_uint8(image)).save(buffer, format="JPEG", quality=quality)
    return buffer.tell() / 1000.0


def jpeg_incompressibility(images: Sequence[Any]) -> list[float]:
    """One reward per image: its JPEG size in kB (bigger = more detail)."""
    return [jpeg_size_kb(im) for im in images]


def jpeg_compressibility(images: Sequence[Any]) -> list[float]:
    """One reward per image: -size_kB / 500 (closer to 0 = more compressible)."""
    return [-size / COMPRESSIBILITY_SCALE for size in jpeg_incompressibility(images)]


def build_compressibility(settings: RewardSettings) -> Scorer:
    """`--rm-type jpeg_compressibility`."""
    return lambda images, prompts, metadata: jpeg_compressibility(images)


def build_incompressibility(settings: RewardSettings) -> Scorer:
    """`--rm-type jpeg_incompressibility`."""
    return lambda images, prompts, metadata: jpeg_incompressibility(images)
