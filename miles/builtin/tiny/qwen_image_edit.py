"""`build_tiny_qwen_image_edit(out_dir, seed)`: tiny-qwen-image's architecture as a `QwenImageEditPlusPipeline`.

tiny-qwen-image's components, sizes and seeds (`miles.builtin.tiny.qwen_image`: the Qwen2.5-VL text encoder with its
1-block vision tower, the Qwen-Image DiT, the causal 3-D VAE, Qwen-Image's scheduler, the digit classifier), saved
as a `QwenImageEditPlusPipeline` directory (Qwen-Image-Edit-2511's layout), except:
  * the tokenizer: the same byte-level BPE learned from the *Plus* template with one picture
    ("Picture 1: <|vision_start|><|image_pad|><|vision_end|>" before each corpus prompt), so the template's system
    prefix is exactly the 64 tokens the pipeline drops;
  * the processor: a `Qwen2VLImageProcessorPil` (14-pixel patches merged 2x2, at most 56 x 56 pixels: 4 image tokens
    per source) saved in `processor/`; the pipeline's `processor` entry is empty, as a `Qwen2VLProcessor` cannot be
    built or loaded without torchvision (the family's `load_pipeline` loads the pipeline without one and makes it);
  * the transformer's config sets `zero_cond_t` (2511's: the source tokens are modulated at timestep 0), the same
    weights as tiny-qwen-image's (the flag adds none); random (training learns it);
  * the VAE is also fitted to the edit task's sources (a 48-pixel digit pasted at an offset of the 64-pixel canvas,
    `miles.data.digits_edit`), as tiny-flux-kontext's;
  * `miles_tiny.json` states the areas the sources are resized to (`edit_image_areas`): the pipeline's 384 x 384 for
    the vision-language copy (the image processor caps it at 56 x 56) and 64 x 64 for the VAE copy (the pipeline's
    ~1 MP would be 4,096 source tokens beside 16 generated ones at 64 pixels).
The directory appears atomically.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from miles.builtin.tiny.build import BuildReport
from miles.builtin.tiny.qwen_image import (
    IMAGE_SIZE,
    VAE_STEPS,
    TinyQwenImageBuild,
    grid_configs,
    make_transformer,
    prompt_token_lengths,
)
from miles.models.tiny.metadata import current_design

__all__ = [
    "TINY_QWEN_IMAGE_EDIT_NAME",
    "BuildReport",
    "build_tiny_qwen_image_edit",
    "grid_configs",  # tiny-qwen-image's: the same scheduler, VAE and transformer input
    "make_image_processor",
]

TINY_QWEN_IMAGE_EDIT_NAME = "tiny-qwen-image-edit"
SGLANG_MODEL_ID = "Qwen-Image-Edit-2511"
PICTURE = "Picture 1: <|vision_start|><|image_pad|><|vision_end|>"  # the Plus template's one-source prefix
VL_MIN_PIXELS = 28 * 28
VL_MAX_PIXELS = 56 * 56  # 4 image tokens (2x2 merged 14-pixel patches) per source
CONDITION_AREA = 384 * 384  # QwenImageEditPlusPipeline's CONDITION_IMAGE_SIZE
VAE_AREA = IMAGE_SIZE * IMAGE_SIZE  # a 64 x 64 source keeps its size
# tokens after the 64-token drop: the picture (4 image tokens and its markers) and the instruction; an edit
# prompt ("make it a 5", spelled partly letter by letter) and the corpus prompts give at most this many
MAX_SEQUENCE_LENGTH = 40


def plus_prompt_template() -> tuple[str, int]:
    """(`prompt_template_encode`, `prompt_template_encode_start_idx`) of the installed QwenImageEditPlusPipeline (an
    empty pipeline built to read them)."""
    from diffusers import QwenImageEditPlusPipeline

    pipe = QwenImageEditPlusPipeline(
        scheduler=None, vae=None, text_encoder=None, tokenizer=None, processor=None, transformer=None
    )
    return pipe.prompt_template_encode, int(pipe.prompt_template_encode_start_idx)


def make_image_processor() -> Any:
    """The vision-language copy's image processor: Qwen2-VL's, capped at 56 x 56 pixels."""
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        min_pixels=VL_MIN_PIXELS, max_pixels=VL_MAX_PIXELS, patch_size=14, merge_size=2, temporal_patch_size=2
    )


def make_edit_transformer(seed: int) -> Any:
    """tiny-qwen-image's transformer (the same weights) with `zero_cond_t` set, as Qwen-Image-Edit-2511's."""
    from diffusers import QwenImageTransformer2DModel

    dit = make_transformer(seed)
    edit = QwenImageTransformer2DModel.from_config(dit.config, zero_cond_t=True)
    edit.load_state_dict(dit.state_dict())
    return edit


class TinyQwenImageEditBuild(TinyQwenImageBuild):
    """tiny-qwen-image's phases; the Plus template's tokenizer, a 2511 DiT config, the VAE also fitted to the edit
    task's sources; saved as a QwenImageEditPlusPipeline with its image processor."""

    name = TINY_QWEN_IMAGE_EDIT_NAME

    def tokenizers(self) -> None:
        from miles.data.digits_edit import prompt_for
        from miles.models.qwen_image import tokenizer as qtok
        from miles.models.tiny.tokenizers import prompt_corpus

        template, drop = plus_prompt_template()
        self.tokenizer = tokenizer = qtok.build_qwen_tokenizer(template.replace("{}", PICTURE + "{}"))
        prefix_len = len(tokenizer(qtok.template_prefix(template)).input_ids)
        assert prefix_len == drop, f"the Plus template's prefix is {prefix_len} tokens, the pipeline drops {drop}"
        image_tokens = VL_MAX_PIXELS // (14 * 2) ** 2
        expand = PICTURE.replace("<|image_pad|>", "<|image_pad|>" * image_tokens)
        edits = [prompt_for(k) for k in range(10)]
        edit_lengths = prompt_token_lengths(tokenizer, [expand + p for p in edits], template, drop)
        corpus_lengths = prompt_token_lengths(tokenizer, [expand + p for p in prompt_corpus()], template, drop)
        assert max(edit_lengths + corpus_lengths) <= MAX_SEQUENCE_LENGTH, (edit_lengths, corpus_lengths)
        self.ids = qtok.token_ids(tokenizer)
        self.tokens = {
            "vocab_size": self.ids["vocab_size"],
            "template_drop": drop,
            "edit_prompt_tokens": max(edit_lengths),
            "corpus_max_prompt_tokens": max(corpus_lengths),
        }

    def transformer(self) -> None:
        self.dit = make_edit_transformer(self.seed)

    def data(self) -> None:
        import torch

        from miles.builtin.tiny.flux_kontext import pasted_digits_vae_input

        super().data()
        self.train = torch.cat([self.train, pasted_digits_vae_input(self.split.train_x)[:, :, None]])

    def pipeline(self) -> Any:
        from diffusers import QwenImageEditPlusPipeline

        from miles.builtin.tiny.qwen_image import make_scheduler

        return QwenImageEditPlusPipeline(
            transformer=self.dit,
            scheduler=make_scheduler(),
            vae=self.vae,
            text_encoder=self.text_encoder,
            tokenizer=self.tokenizer,
            processor=None,  # made on load from processor/ (a Qwen2VLProcessor needs torchvision to load)
        )

    def save(self) -> None:
        super().save()
        make_image_processor().save_pretrained(self.out / "processor")

    def metadata(self, report: BuildReport) -> dict[str, Any]:
        from miles.models.qwen_image_edit.config import AREAS_KEY

        return {
            **super().metadata(report),
            "name": TINY_QWEN_IMAGE_EDIT_NAME,
            "design": current_design(TINY_QWEN_IMAGE_EDIT_NAME),
            "max_sequence_length": MAX_SEQUENCE_LENGTH,
            "data": {"name": "digits-edit"},
            "sglang_model_id": SGLANG_MODEL_ID,
            AREAS_KEY: {"condition": CONDITION_AREA, "vae": VAE_AREA},
            "condition": {"images": [1, 3], "vl_max_pixels": VL_MAX_PIXELS, "zero_cond_t": True},
        }


def build_tiny_qwen_image_edit(
    out_dir: str | Path, seed: int = 0, progress: bool = True, vae_steps: int = VAE_STEPS
) -> BuildReport:
    """Build tiny-qwen-image-edit into `out_dir` (which must not exist, or be empty); return timings and accuracies."""
    return TinyQwenImageEditBuild.build(out_dir, seed, progress, vae_steps)
