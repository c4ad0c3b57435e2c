"""SFT data: image + caption JSONL rows, encoded once into clean latents and prompt conditions.

A row is `{"image": "path.png", "<input-key>": "caption", "metadata": {...}}` or, for a video family,
`{"video": "clip.webp", ...}` (animated WebP/GIF; frames at `--sft-frame-stride`, the first
`--diffusion-output-num-frames` of them when that is > 1); a relative path is relative to the JSONL file. A row may
carry condition media at `--media-key` (an edit's source image, `miles.data.media`): read and checked here, not yet
used by the trainer.
Images (and frames) are resized (center crop) to `--diffusion-height/width`
and encoded with the pipeline's VAE (`--sft-encoder-checkpoint`, default `--hf-checkpoint`) into
normalised latents; captions are encoded once each. A caption is replaced by the negative prompt's
conditions with probability `SFT_CFG_DROPOUT`, so classifier-free guidance works at sampling time.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from miles.core.errors import ConfigError
from miles.core.sample import Conditions, Sample
from miles.data.prompt_file import PromptKeys, iter_jsonl_objects
from miles.data.prompts import check_sft_row
from miles.models.pipeline_config import prompt_geometry

SFT_CFG_DROPOUT = 0.1


@dataclass
class SFTDataset:
    latents: torch.Tensor  # [N, C, h, w] normalised, fp32 (a video family's: [N, C, f, h, w])
    conditions: list[Conditions]  # per row: positive = caption; negative = the empty prompt
    prompts: list[str]
    metadata: list[dict[str, Any]]

    def __len__(self) -> int:
        return int(self.latents.shape[0])

    def batch(self, rows: list[int], generator: torch.Generator) -> tuple[torch.Tensor, list[Sample]]:
        """Clean latents and conditioning samples for `rows`, with caption dropout for CFG."""
        drop = torch.rand(len(rows), generator=generator) < SFT_CFG_DROPOUT
        samples = []
        for k, (row, dropped) in enumerate(zip(rows, drop.tolist(), strict=True)):
            cond = self.conditions[row]
            positive = cond.negative if dropped and cond.negative is not None else cond.positive
            samples.append(
                Sample(
                    index=k,
                    group_index=row,
                    prompt="" if dropped else self.prompts[row],
                    metadata=self.metadata[row],
                    conditions=Conditions(positive, None, 1.0),
                )
            )
        return self.latents[rows], samples


def read_rows(path: Path, input_key: str, media_key: str | None = "media") -> list[dict[str, Any]]:
    """The SFT rows of `path`, each checked (its caption, its file keys, its media list: `check_sft_row`)."""
    return [row for row, _ in read_rows_with_media(path, input_key, media_key)]


def read_rows_with_media(
    path: Path, input_key: str, media_key: str | None = "media"
) -> list[tuple[dict[str, Any], tuple[Any, ...]]]:
    """The SFT rows of `path` and each one's media (`MediaRef`s, in the row's order)."""
    keys = PromptKeys(input=input_key, media=media_key)
    rows = []
    for where, _, row in iter_jsonl_objects(path, "SFT data"):
        rows.append((row, check_sft_row(where, row, keys, path.parent)))
    if not rows:
        raise ConfigError(f"{path}: no SFT rows")
    return rows


def _load_image(path: Path, size: tuple[int, int]) -> np.ndarray:
    from PIL import Image

    if not path.is_file():
        raise ConfigError(f"SFT image not found: {path}")
    try:
        image = Image.open(path).convert("RGB")
    except (OSError, SyntaxError, ValueError) as exc:  # PIL's UnidentifiedImageError is an OSError
        detail = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError(f"SFT image {path} does not decode ({detail[:120]})") from None
    w, h = image.size
    side = min(w, h)
    image = image.crop(((w - side) // 2, (h - side) // 2, (w + side) // 2, (h + side) // 2))
    image = image.resize((size[1], size[0]), Image.BICUBIC)
    return np.asarray(image, dtype=np.float32) / 255.0


def _load_pixels(root: Path, row: dict[str, Any], size: tuple[int, int], stride: int, frames: int | None) -> Any:
    """A row's image `[3, H, W]` or video `[3, F, H, W]` in [0, 1] (video frames at `--sft-frame-stride`)."""
    if "video" in row:
        from miles.io.video import load_sft_video

        video = load_sft_video((root / row["video"]).resolve(), size, frame_stride=stride, num_frames=frames)
        return torch.from_numpy(video).permute(3, 0, 1, 2)
    if stride != 1 or (frames or 1) > 1:
        raise ConfigError(f"SFT row with image {row['image']!r}: frames and --sft-frame-stride need 'video' rows")
    return torch.from_numpy(_load_image((root / row["image"]).resolve(), size)).permute(2, 0, 1)


@dataclass
class Encoder:
    """What encodes `train sft` rows: the family and its pipeline without the transformer."""

    family: Any
    checkpoint: Path
    pipe: Any
    size: tuple[int, int]  # (--diffusion-height, --diffusion-width)


def data_path(args: Any) -> Path:
    """The `--prompt-data` file (a built-in set is made on first use)."""
    from miles.core.inputs import input_path

    return Path(input_path(args, args.prompt_data))


def open_encoder(args: Any) -> Encoder:
    """The pipeline (`--sft-encoder-checkpoint`, default `--hf-checkpoint`) that encodes the rows' images and
    captions."""
    from miles.core.inputs import input_path
    from miles.models.loading import quiet_loading
    from miles.training.model import family_of

    family = family_of(args)
    checkpoint = input_path(args, args.sft_encoder_checkpoint or args.hf_checkpoint)
    family.bind_checkpoint(checkpoint)  # what the latent layout reads from it (e.g. LTX-2's audio planes)
    with quiet_loading():
        pipe = family.load_pipeline(checkpoint, transformer=None, dtype=torch.float32)
    return Encoder(family, checkpoint, pipe, (int(args.diffusion_height), int(args.diffusion_width)))


def load_image(path: Path, size: tuple[int, int]) -> torch.Tensor:
    """An image file `[3, H, W]` in [0, 1], center-cropped and resized to `size` (ConfigError if it is missing or
    does not decode)."""
    return torch.from_numpy(_load_image(path, size)).permute(2, 0, 1)


def encode_pixels(encoder: Encoder, pixels: torch.Tensor) -> torch.Tensor:
    """Normalised latents of `[B, 3, ...]` pixels in [0, 1]."""
    return encoder.family.encode_images(encoder.pipe, pixels * 2 - 1)


def caption_conditions(args: Any, encoder: Encoder, captions: list[str]) -> dict[str, Conditions]:
    """Each distinct caption's conditions (positive; negative = the negative prompt, where the family has CFG)."""
    from miles.models.tiny.metadata import max_sequence_length

    family = encoder.family
    max_len = max_sequence_length(encoder.checkpoint, default=family.max_sequence_length)
    cache: dict[str, Conditions] = {}
    for caption in dict.fromkeys(captions):
        pos, neg = family.encode_prompts(
            encoder.pipe,
            [caption],
            args.diffusion_negative_prompt,
            family.supports_cfg_training,  # an unguided family (LTX-2) has no negative conditions to drop to
            max_len,
            guidance=family.embedded_guidance(args.diffusion_guidance_scale),
            geometry=prompt_geometry(args),
        )
        cache[caption] = Conditions(
            {k: v[0].float() for k, v in pos.items()},
            {k: v[0].float() for k, v in neg.items()} if neg is not None else None,
            1.0,
        )
    return cache


def media_conditions(
    encoder: Encoder, media: tuple[Any, ...], cond: Conditions, prompts: tuple[str, str | None]
) -> Conditions:
    """A row's caption conditions `cond` with its condition images in them (`condition_media`, as the engine
    encodes a prompt row's); `prompts` = (the caption, the negative prompt)."""
    from miles.data.media import open_condition_images

    images = open_condition_images(ref.path for ref in media)
    height, width = encoder.size
    pos, neg = encoder.family.condition_media(
        encoder.pipe, images, height, width, prompts, cond.positive, cond.negative
    )
    negative = None if neg is None else {k: v.float() for k, v in neg.items()}
    return Conditions({k: v.float() for k, v in pos.items()}, negative, cond.guidance_scale)


@torch.no_grad()
def encode_sft_dataset(args: Any, batch_size: int = 64) -> SFTDataset:
    path = data_path(args)
    with_media = read_rows_with_media(path, args.input_key, args.media_key)
    rows = [row for row, _ in with_media]
    encoder = open_encoder(args)
    size = encoder.size
    frames = int(args.diffusion_output_num_frames)
    stride = int(args.sft_frame_stride or 1)
    latents = []
    for i in range(0, len(rows), batch_size):
        cut = frames if frames > 1 else None
        batch = [_load_pixels(path.parent, r, size, stride, cut) for r in rows[i : i + batch_size]]
        shapes = {tuple(b.shape) for b in batch}
        if len(shapes) != 1:
            raise ConfigError(
                f"{path}: SFT rows {i}..{i + len(batch) - 1} decode to different shapes {sorted(shapes)}; videos "
                "need equal frame counts (set --diffusion-output-num-frames to cut them)"
            )
        latents.append(encode_pixels(encoder, torch.stack(batch)))
    captions = [str(r[args.input_key]) for r in rows]
    cache = caption_conditions(args, encoder, captions)
    conditions = [cache[c] for c in captions]
    if encoder.family.condition_images != (0, 0):  # each row's source in both branches (the dropout keeps it)
        encoded: dict[tuple[Any, ...], Conditions] = {}  # rows that share caption and sources share them
        negative = args.diffusion_negative_prompt
        for caption, (_, media) in zip(captions, with_media, strict=True):
            if (caption, media) not in encoded:  # MediaRefs are frozen: a row's tuple of them is its key
                prompts = (caption, negative)
                encoded[caption, media] = media_conditions(encoder, media, cache[caption], prompts)
        conditions = [encoded[c, media] for c, (_, media) in zip(captions, with_media, strict=True)]
    return SFTDataset(
        latents=torch.cat(latents).float(),
        conditions=conditions,
        prompts=captions,
        metadata=[dict(r.get(args.metadata_key) or {}) for r in rows],
    )
