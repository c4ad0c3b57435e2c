"""Offline DPO data (`train sft --loss-type dpo`): preference rows (`miles.training.preference_rows`) encoded once
into the chosen and rejected images' clean latents and the caption's conditions.

Images are resized (center crop) to `--diffusion-height/width` and encoded with the pipeline's VAE
(`--sft-encoder-checkpoint`, default `--hf-checkpoint`), as SFT images are (`miles.training.sft_data`). There is no
caption dropout: DPO trains the conditional velocity only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from miles.core.errors import ConfigError
from miles.core.sample import Conditions, Sample
from miles.training.preference_rows import read_preference_rows
from miles.training.sft_data import caption_conditions, data_path, encode_pixels, load_image, open_encoder


@dataclass
class PreferenceDataset:
    latents: torch.Tensor  # [N, 2, C, h, w] normalised, fp32: each row's chosen, then rejected latent
    conditions: list[Conditions]  # per row: its caption (positive only)
    prompts: list[str]
    metadata: list[dict[str, Any]]

    def __len__(self) -> int:
        return int(self.latents.shape[0])

    def batch(self, rows: list[int], generator: torch.Generator) -> tuple[torch.Tensor, list[Sample]]:
        """`[B, 2, ...]` latents of `rows` (chosen, rejected) and their caption samples (`generator` is not drawn
        from: no caption dropout)."""
        samples = [
            Sample(
                index=k,
                group_index=row,
                prompt=self.prompts[row],
                metadata=self.metadata[row],
                conditions=Conditions(self.conditions[row].positive, None, 1.0),
            )
            for k, row in enumerate(rows)
        ]
        return self.latents[rows], samples


@torch.no_grad()
def encode_preference_dataset(args: Any, batch_size: int = 32) -> PreferenceDataset:
    path = data_path(args)
    rows = read_preference_rows(path, args)
    if int(args.diffusion_output_num_frames or 1) > 1:
        raise ConfigError(
            f"--prompt-data {path}: preference rows hold images, and --diffusion-output-num-frames "
            f"{args.diffusion_output_num_frames} asks for videos"
        )
    encoder = open_encoder(args)
    latents = []
    for i in range(0, len(rows), batch_size):
        cut = rows[i : i + batch_size]
        names = [name for r in cut for name in (r.chosen, r.rejected)]
        pixels = [load_image((path.parent / name).resolve(), encoder.size) for name in names]
        encoded = encode_pixels(encoder, torch.stack(pixels)).float()
        latents.append(encoded.reshape(len(cut), 2, *encoded.shape[1:]))
    captions = [r.caption for r in rows]
    cache = caption_conditions(args, encoder, captions)
    return PreferenceDataset(
        latents=torch.cat(latents),
        conditions=[cache[c] for c in captions],
        prompts=captions,
        metadata=[r.metadata for r in rows],
    )
