"""Plain-torch reference math shared by the preference-model reward tests (`tests/rewards/`): the formulas the
scorers must reproduce, written out independently of the code under test (no transformers modules)."""

from __future__ import annotations

import math

import numpy as np
import torch

OPENAI_MEAN = torch.tensor([0.48145466, 0.4578275, 0.40821073]).view(3, 1, 1)
OPENAI_STD = torch.tensor([0.26862954, 0.26130258, 0.27577711]).view(3, 1, 1)


def noise_image(seed: int, height: int = 32, width: int = 32) -> torch.Tensor:
    """A [3, H, W] float image in [0, 1]."""
    return torch.rand(3, height, width, generator=torch.Generator().manual_seed(seed))


def to_uint8(image: torch.Tensor) -> np.ndarray:
    """[3, H, W] in [0, 1] -> (H, W, 3) uint8, x 255 rounded (flow_grpo's conversion)."""
    return (image.permute(1, 2, 0).numpy() * 255.0).round().clip(0, 255).astype(np.uint8)


def eval_pixels(image: torch.Tensor, size: int) -> torch.Tensor:
    """torchvision's Resize(size, bicubic) + CenterCrop(size) + ToTensor + Normalize(OpenAI), spelled out with PIL:
    [3, H, W] float -> [3, size, size]."""
    from PIL import Image

    pil = Image.fromarray(to_uint8(image))
    w, h = pil.size
    if w <= h:
        new_w, new_h = size, int(size * h / w)
    else:
        new_w, new_h = int(size * w / h), size
    if (new_w, new_h) != (w, h):
        pil = pil.resize((new_w, new_h), resample=Image.BICUBIC)
    top, left = round((new_h - size) / 2), round((new_w - size) / 2)
    pil = pil.crop((left, top, left + size, top + size))
    x = torch.from_numpy(np.asarray(pil, dtype=np.float32) / 255.0).permute(2, 0, 1)
    return (x - OPENAI_MEAN) / OPENAI_STD


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * weight + bias


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    y = x @ weight.T
    return y if bias is None else y + bias


def gelu(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, additive_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Multi-head scaled dot-product attention on already projected (B, L, D) q and (B, S, D) k/v."""
    b, length, d = q.shape
    hd = d // heads

    def split(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(b, t.shape[1], heads, hd).transpose(1, 2)

    scores = split(q) @ split(k).transpose(-1, -2) / math.sqrt(hd)
    if additive_mask is not None:
        scores = scores + additive_mask
    out = torch.softmax(scores, dim=-1) @ split(v)
    return out.transpose(1, 2).reshape(b, length, d)


def normalized(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True)


def random_tensors(shapes: dict[str, tuple[int, ...]], seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """Random weights for hand-built checkpoints: LayerNorm-like (`ln`/`norm`/`LayerNorm` weights) around 1, the rest
    N(0, scale^2)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in shapes.items():
        t = torch.randn(shape, generator=gen) * scale
        leaf = name.rsplit(".", 2)[-2] if name.count(".") else name
        if name.endswith(".weight") and any(tag in leaf for tag in ("ln", "norm", "LayerNorm")):
            t = 1.0 + t
        out[name] = t
    return out
