"""Image grids labelled with prompt and reward, for people to look at (PNG)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

from miles.utils.atomic import atomic_open

_LABEL_H = 28


def _tile(image: torch.Tensor, size: int) -> Image.Image:
    arr = (image.detach().float().clamp(0, 1).permute(1, 2, 0).cpu().numpy() * 255).round().astype(np.uint8)
    tile = Image.fromarray(arr)
    return tile.resize((size, size), Image.NEAREST) if tile.size != (size, size) else tile


def save_grid(
    path: str | os.PathLike, images: Sequence[torch.Tensor], labels: Sequence[str], columns: int = 8, size: int = 128
) -> Path:
    """Write images `[3, H, W]` in [0, 1] as one PNG grid, each tile captioned with its label (2 lines)."""
    if len(images) != len(labels):
        raise ValueError(f"{len(images)} images but {len(labels)} labels")
    columns = max(1, min(columns, len(images)))
    rows = max(1, -(-len(images) // columns))
    sheet = Image.new("RGB", (columns * size, rows * (size + _LABEL_H)), "white")
    draw = ImageDraw.Draw(sheet)
    font = ImageFont.load_default(size=10)
    for k, (image, label) in enumerate(zip(images, labels, strict=True)):
        x, y = (k % columns) * size, (k // columns) * (size + _LABEL_H)
        sheet.paste(_tile(image, size), (x, y))
        for line_no, line in enumerate(_wrap(label, size // 6)[:2]):
            draw.text((x + 2, y + size + 2 + 12 * line_no), line, fill="black", font=font)
    with atomic_open(path, "wb") as handle:
        sheet.save(handle, format="PNG")
    return Path(path)


def _wrap(text: str, width: int) -> list[str]:
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}".strip()
    if line:
        lines.append(line)
    return lines or [""]
