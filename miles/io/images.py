"""Image grids labelled with prompt and reward, for people to look at (PNG; videos: `miles.io.video`)."""

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
    if image.dim() == 4:  # a video: its first frame ([3, F, H, W]; [F, 3, H, W] too)
        image = image[:, 0] if image.shape[0] in (1, 3) else image[0]
    if image.shape[0] == 1:
        image = image.expand(3, -1, -1)
    arr = (image.detach().float().clamp(0, 1).permute(1, 2, 0).cpu().numpy() * 255).round().astype(np.uint8)
    tile = Image.fromarray(arr)
    return tile.resize((size, size), Image.NEAREST) if tile.size != (size, size) else tile


def save_grid(
    path: str | os.PathLike, images: Sequence[torch.Tensor], labels: Sequence[str], columns: int = 8, size: int = 128
) -> Path:
    """Write images `[3, H, W]` in [0, 1] as one PNG grid, each tile captioned with its label (2 lines).

    Videos go to `miles.io.video.save_video_grid` (an animated grid, frame by frame, from `grid_sheet`)."""
    sheet = grid_sheet(images, labels, columns, size)
    with atomic_open(path, "wb") as handle:
        sheet.save(handle, format="PNG")
    return Path(path)


def grid_sheet(
    images: Sequence[torch.Tensor], labels: Sequence[str], columns: int = 8, size: int = 128
) -> Image.Image:
    """The grid of `save_grid` as a PIL RGB image: `columns` tiles of `size` px a row, each captioned."""
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
    return sheet


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
