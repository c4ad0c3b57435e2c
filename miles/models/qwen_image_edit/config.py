"""The `qwen_image_edit` family: Qwen-Image-Edit-Plus (Qwen-Image-Edit-2509, -2511), `QwenImageEditPlusPipeline`.

Torch-free at import. Everything of `qwen_image` holds (the 20B MM-DiT over 2x2-packed tokens, t/1000, true CFG with
the per-token norm rescale, the dynamic shift from the *generated* token count, the per-channel VAE statistics); what
the Plus pipeline adds is one to three source images per prompt row, each used twice:
  * the vision-language copy: the source resized to `CONDITION_IMAGE_SIZE` (384 x 384) area, aspect kept, sides
    multiples of 32 (`copy_size`: the pipeline's `calculate_dimensions`), which Qwen2.5-VL's image processor then
    cuts into 14-pixel patches (about 196 image tokens at 384 x 384). The text condition is the Plus template with
    "Picture k: <|vision_start|><|image_pad|><|vision_end|>" before the instruction, encoded *with* the images
    (`pipe.encode_prompt(image=...)`): the text states carry the image's VLM states, so they depend on the source.
    The negative prompt is encoded with the same images;
  * the VAE copy: the source resized to `VAE_IMAGE_SIZE` (1024 x 1024) area, aspect kept, sides multiples of 32, as
    the pipeline does whatever the output size (so a source keeps its own size only when it is ~1 MP already).
    A tiny build states smaller areas in its `miles_tiny.json` (`edit_image_areas`): at 64 pixels a 1 MP source
    would be 4,096 tokens beside 16 generated ones. The latents (posterior mode, normalised per channel) are packed
    2x2 as the generated ones: `ref_tokens` [1, N_ref, 4C], and each source's latent grid (h, w) is `ref_grid`
    [1, K, 2]. The memory plan traces one source of the output's aspect sized by the same function
    (`example_media_conditions`): at 512 x 512, 1,024 generated tokens, then 4,096 of the source;
  * every step runs the DiT on `[pack(x_t) ; ref_tokens]` with `img_shapes = [[(1, h/2, w/2), (1, h_1/2, w_1/2),
    ...]]` per row (the generated grid, then each source's: RoPE frame index k for item k) and keeps the first N_gen
    outputs: the source tokens are inputs only, never noised, stepped, in a log-prob or in a loss.
  * Qwen-Image-Edit-2511's transformer config sets `zero_cond_t` (diffusers' `QwenImageTransformer2DModel`): the DiT
    modulates the source tokens with the timestep-0 embedding. It is the DiT's own config, read by the DiT; it needs
    `img_shapes` as one list per row, which is what `forward_velocity` always passes.
The engine encodes each prompt row's sources once (`condition_media`): the text states with the images, the packed
source tokens and their grids are recorded with the sample in both branches, so the trainer recomputes exactly what
the rollout ran without the VLM, the VAE or the images.

The pipeline's processor (`Qwen2VLProcessor`) needs torchvision to load (its video processor; transformers 5.25);
a checkpoint that lists none (tiny-qwen-image-edit) is loaded without one (`load_pipeline`) and `vl_processor`
builds it from the checkpoint's `processor/` image-processor config and the pipeline's tokenizer.
The first Qwen-Image-Edit (`QwenImageEditPipeline`: one image, 1 MP for both copies, its own template) is not this
path and is refused by name.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from miles.models.families import register_train_pipeline_config
from miles.models.flux.config import pack_latents, unpack_latents
from miles.models.qwen_image.config import QwenImageTrainPipelineConfig

# QwenImageEditPlusPipeline's module constants (diffusers 0.42.1): the areas of the two copies of a source. The engine
# and the memory plan read these (torch-free), tests/models/test_qwen_image_edit.py pins them to diffusers'
CONDITION_IMAGE_SIZE = 384 * 384
VAE_IMAGE_SIZE = 1024 * 1024
COPY_MULTIPLE = 32  # the copies' sides, in pixels
AREAS_KEY = "edit_image_areas"  # a tiny build's miles_tiny.json: {"condition": px, "vae": px}
# Qwen2.5-VL's image patches: 14 pixels, 2x2 merged into one token
VL_PATCH = 14
VL_MERGE = 2
# the text tokens around one picture's image tokens: "Picture 1: " and the vision start/end markers (an allowance)
VL_PICTURE_TOKENS = 8
TEXT_KEYS = ("encoder_hidden_states", "encoder_hidden_states_mask")
SOURCE_KEYS = ("ref_tokens", "ref_grid")


def copy_size(area: int, width: int, height: int) -> tuple[int, int]:
    """(width, height) of a `width` x `height` source's copy at `area` pixels, as `QwenImageEditPlusPipeline`
    resizes it (diffusers' `calculate_dimensions`: the aspect kept, each side rounded to a multiple of 32); torch-free,
    so the engine and the memory plan size a source by the same function (tests pin it to diffusers')."""
    ratio = width / height
    w = math.sqrt(area * ratio)
    h = w / ratio
    return round(w / COPY_MULTIPLE) * COPY_MULTIPLE, round(h / COPY_MULTIPLE) * COPY_MULTIPLE


def traced_grid(tokens: int, output_grid: tuple[int, int]) -> tuple[int, int]:
    """The latent grid (h, w) of one source of `tokens` packed tokens with the output's aspect: the whole 2x2-packed
    grid (a, b), a * b = tokens, whose a / b is nearest the output's h / w (the plan's example: a square output
    gives a square source)."""
    h, w = output_grid
    pairs = [(d, tokens // d) for d in range(1, math.isqrt(tokens) + 1) if tokens % d == 0]
    pairs += [(b, a) for a, b in pairs]
    a, b = min(pairs, key=lambda p: abs(math.log(p[0] / p[1]) - math.log(h / w)))
    return 2 * a, 2 * b


def vl_image_tokens(area: int = CONDITION_IMAGE_SIZE) -> int:
    """The VLM's image tokens of one square source at `area` pixels (196 at 384 x 384): the side rounded to whole
    merged patches (28 pixels), one token per merged patch."""
    side = max(1, round(area**0.5 / (VL_PATCH * VL_MERGE)))
    return side * side


def source_grids(grid: Any, tokens: int, output_grid: tuple[int, int]) -> list[tuple[int, int]]:
    """Each source's latent grid (h, w), read from a row's recorded `ref_grid` [K, 2] (a batch's [B, K, 2]: its first
    row, as a batch shares its geometry). Under the memory plan's trace (fake or meta tensors, whose values cannot be
    read) the K sources share the tokens equally and have the output's aspect (`traced_grid`), as the plan's example
    (`example_media_conditions`); tokens that K sources cannot share equally are a ValueError."""
    from torch._subclasses.fake_tensor import is_fake

    k = int(grid.shape[-2])
    if is_fake(grid) or grid.device.type == "meta":
        if tokens % k:
            raise ValueError(f"a traced batch of {k} sources in {tokens} packed tokens: only equal sources are traced")
        return [traced_grid(tokens // k, output_grid)] * k
    return [(int(a), int(b)) for a, b in grid.reshape(-1, k, 2)[0].tolist()]


def vl_processor(pipe: Any) -> Any:
    """The pipeline's `Qwen2VLProcessor`; for a pipeline loaded without one (no torchvision, or a tiny build), one
    made from the checkpoint's `processor/` image-processor config and the pipeline's tokenizer, set on the pipeline.

    Made without `Qwen2VLProcessor.__init__`, whose class check looks up the video processor that needs torchvision;
    the pipeline calls it on text and images only, which need the image processor, the tokenizer and the image
    token."""
    from pathlib import Path

    from transformers import Qwen2VLImageProcessorPil, Qwen2VLProcessor

    if getattr(pipe, "processor", None) is not None:
        return pipe.processor
    folder = Path(pipe.name_or_path or "") / "processor"
    if not (folder / "preprocessor_config.json").is_file():
        raise FileNotFoundError(f"{folder}: no image-processor config for Qwen-Image-Edit's vision-language encoder")
    tokenizer = pipe.tokenizer
    processor = object.__new__(Qwen2VLProcessor)
    processor.chat_template = None
    processor.image_processor = Qwen2VLImageProcessorPil.from_pretrained(folder)
    processor.tokenizer = tokenizer
    processor.video_processor = None
    processor.image_token, processor.video_token = "<|image_pad|>", "<|video_pad|>"
    processor.image_token_id = tokenizer.convert_tokens_to_ids(processor.image_token)
    processor.video_token_id = tokenizer.convert_tokens_to_ids(processor.video_token)
    pipe.processor = processor
    return processor


@register_train_pipeline_config("qwen_image_edit")
class QwenImageEditTrainPipelineConfig(QwenImageTrainPipelineConfig):
    description = (
        "Qwen-Image-Edit-Plus image editing (2509, 2511: Qwen-Image's MM-DiT, the sources' packed tokens in the "
        "sequence, the text encoded with the sources by Qwen2.5-VL), incl. tiny-qwen-image-edit"
    )
    hf_ckpt_name_patterns = ("qwen-image-edit", "qwen_image_edit", "qwenimageedit", "tiny-qwen-image-edit")
    pipeline_class = "diffusers.QwenImageEditPlusPipeline"
    condition_inputs = (*TEXT_KEYS, *SOURCE_KEYS)
    condition_images = (1, 3)  # the pipeline takes any number; miles stops at 3 (each adds a source's tokens)
    sglang_model_id = "Qwen-Image-Edit-2511"
    sglang_unserved = (
        "miles does not send condition images to sglang-diffusion yet (whether its server returns Qwen-Image-Edit "
        "trajectories is unverified); the in-process engine serves it"
    )

    def load_pipeline(self, checkpoint: Any, **kwargs: Any) -> Any:
        """`QwenImageEditPlusPipeline.from_pretrained`; a checkpoint that lists no processor (a tiny build's
        `[null, null]`) is loaded without one and given `vl_processor`'s."""
        import json
        from pathlib import Path

        index = Path(checkpoint) / "model_index.json"
        listed = json.loads(index.read_text()).get("processor") if index.is_file() else ["transformers"]
        if "processor" not in kwargs and (listed or [None])[0] is None:
            kwargs["processor"] = None
        pipe = super().load_pipeline(checkpoint, **kwargs)
        if pipe.processor is None:
            vl_processor(pipe)
        return pipe

    # ---- the sources' two copies -------------------------------------------------------------------------------
    def image_areas(self, pipe: Any) -> tuple[int, int]:
        """(the VLM copy's area, the VAE copy's area) in pixels: a tiny build's `edit_image_areas` (its metadata in
        the folder `pipe.name_or_path`), else the pipeline's `CONDITION_IMAGE_SIZE` and `VAE_IMAGE_SIZE`. Torch-free:
        `pipe` may be the memory plan's stand-in (`config_pipe` with the checkpoint as `name_or_path`)."""
        from miles.models.tiny.metadata import read_metadata

        meta = read_metadata(pipe.name_or_path) if getattr(pipe, "name_or_path", None) else None
        areas = (meta or {}).get(AREAS_KEY)
        if areas:
            return int(areas["condition"]), int(areas["vae"])
        return CONDITION_IMAGE_SIZE, VAE_IMAGE_SIZE

    def copy_sizes(self, pipe: Any, width: int, height: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """((width, height) of the VLM copy, (width, height) of the VAE copy) of a `width` x `height` source: each
        `copy_size` at its `image_areas`. The engine encodes these; the memory plan traces the VAE copy's tokens."""
        condition_area, vae_area = self.image_areas(pipe)
        return copy_size(condition_area, width, height), copy_size(vae_area, width, height)

    def encode_sources(self, pipe: Any, images: list[Any]) -> tuple[list[Any], dict[str, Any]]:
        """(the VLM copies as PIL images, {`ref_tokens` [1, N_ref, 4C], `ref_grid` [1, K, 2]}): each source resized
        as the pipeline resizes it (`copy_sizes`: `calculate_dimensions` at each area; the pipeline's image
        processor), the VAE copies encoded (posterior mode), normalised per channel and packed, in the rows' order."""
        import torch

        vae = pipe.vae
        copies, tokens, grids = [], [], []
        for image in images:
            (cw, ch), (vw, vh) = self.copy_sizes(pipe, *image.size)
            copies.append(pipe.image_processor.resize(image, ch, cw))
            pixels = pipe.image_processor.preprocess(image, vh, vw).unsqueeze(2)
            z = vae.encode(pixels.to(device=vae.device, dtype=vae.dtype)).latent_dist.mode()
            mean, std = self._stats(vae, z)
            z = ((z - mean) / std)[:, :, 0]
            tokens.append(pack_latents(z))
            grids.append([int(z.shape[-2]), int(z.shape[-1])])
        ref = torch.cat(tokens, dim=1)
        return copies, {"ref_tokens": ref, "ref_grid": torch.tensor([grids], dtype=torch.int64, device=ref.device)}

    def encode_text(self, pipe: Any, text: str, copies: list[Any]) -> dict[str, Any]:
        """One text's states encoded with the sources' VLM copies (the Plus template, "Picture k" per source, the
        template's 64 tokens dropped: `pipe.encode_prompt`), without a batch dimension, and its mask (all ones)."""
        import torch

        vl_processor(pipe)
        embeds, mask = pipe.encode_prompt(prompt=[text], image=copies, device=pipe._execution_device)
        if mask is None:
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        return {"encoder_hidden_states": embeds[0], "encoder_hidden_states_mask": mask[0]}

    def condition_media(
        self,
        pipe: Any,
        images: list[Any],
        height: int,
        width: int,
        prompts: tuple[str, str | None],
        pos: Mapping[str, Any],
        neg: Mapping[str, Any] | None,
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """The row's text encoded again with its sources (the prompt; the negative, " " by default, with the same
        sources) and the sources' packed tokens in both branches: what `QwenImageEditPlusPipeline` computes."""
        prompt, negative = prompts
        copies, source = self.encode_sources(pipe, images)
        source = {k: v[0] for k, v in source.items()}
        positive = {**pos, **self.encode_text(pipe, prompt, copies), **source}
        if neg is None:
            return positive, None
        text = negative if negative is not None else " "
        return positive, {**neg, **self.encode_text(pipe, text, copies), **source}

    def encode_media(self, pipe: Any, images: list[Any], height: int, width: int) -> dict[str, Any]:
        """The sources' packed tokens and grids alone (the text with them is `condition_media`'s)."""
        return self.encode_sources(pipe, images)[1]

    def encode_prompts(
        self,
        pipe: Any,
        prompts: list[str],
        negative_prompt: str | None,
        do_cfg: bool,
        max_sequence_length: int,
        guidance: float | None = None,
        geometry: Any = None,
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """The prompts in the Plus template without a picture (qwen_image's path on this pipeline). A conditioned
        row's text is encoded again with its sources (`condition_media`), which replaces these states."""
        vl_processor(pipe)
        return super().encode_prompts(
            pipe, prompts, negative_prompt, do_cfg, max_sequence_length, guidance=guidance, geometry=geometry
        )

    # ---- batches: the text padded as qwen_image's, the sources stacked (one geometry per batch) ------------------
    def collate_conditions(self, rows: list[Any]) -> dict[str, Any]:
        """The text padded to the longest row (qwen_image's); the sources stacked, which needs every row's sources
        to have the same grids (the DiT takes one `img_shapes` per batch)."""
        import torch
        from torch._subclasses.fake_tensor import is_fake

        first = rows[0]
        for r in rows[1:]:
            same = (
                r["ref_tokens"].shape == first["ref_tokens"].shape and r["ref_grid"].shape == first["ref_grid"].shape
            )
            grid = r["ref_grid"]
            if same and not (is_fake(grid) or grid.device.type == "meta"):
                same = torch.equal(grid.to(first["ref_grid"].device), first["ref_grid"])
            if not same:
                raise ValueError(
                    f"model family {self.name!r}: rows with sources of different sizes in one batch (grids "
                    f"{first['ref_grid'].tolist()} and {grid.tolist()}); the DiT takes one geometry per batch"
                )
        text = super().collate_conditions(rows)
        return {**text, **{k: torch.stack([r[k] for r in rows]) for k in SOURCE_KEYS}}

    def condition_row(self, batch: Mapping[str, Any], row: int) -> dict[str, Any]:
        """qwen_image's text row, and the row's sources (where the batch has them: `encode_prompts` gives none)."""
        return {**super().condition_row(batch, row), **{k: batch[k][row] for k in SOURCE_KEYS if k in batch}}

    # ---- forward -----------------------------------------------------------------------------------------------
    def forward_velocity(self, transformer: Any, latents: Any, timestep: Any, cond: dict[str, Any]) -> Any:
        """The DiT on the generated tokens followed by the sources', `img_shapes` per row (generated grid, then each
        source's), t/1000, the mask None when all ones; the generated part of the output."""
        import torch

        b, h, w = int(latents.shape[0]), int(latents.shape[-2]), int(latents.shape[-1])
        mask = cond["encoder_hidden_states_mask"]  # None: every token attends (the memory plan's trace)
        mask = None if mask is None or bool(mask.bool().all()) else mask.to(latents.device).long()
        ref = cond["ref_tokens"].to(latents.dtype)
        tokens = pack_latents(latents)
        n_gen = tokens.shape[1]
        grids = source_grids(cond["ref_grid"], int(ref.shape[1]), (h, w))
        shapes = [(1, h // 2, w // 2), *[(1, gh // 2, gw // 2) for gh, gw in grids]]
        out = transformer(
            hidden_states=torch.cat([tokens, ref], dim=1),
            timestep=timestep.to(latents.dtype) / 1000,
            guidance=None,
            encoder_hidden_states_mask=mask,
            encoder_hidden_states=cond["encoder_hidden_states"],
            img_shapes=[shapes] * b,
            return_dict=False,
        )[0]
        return unpack_latents(out[:, :n_gen], h, w)

    # ---- the memory plan ---------------------------------------------------------------------------------------
    def example_conditions(self, configs: Any, text_length: int) -> dict[str, Any]:
        """qwen_image's, with one source's VLM image tokens (at the pipeline's 384 x 384 area) and their picture
        markers in the text."""
        return super().example_conditions(configs, int(text_length) + vl_image_tokens() + VL_PICTURE_TOKENS)

    def example_media_conditions(self, latent_shape: tuple[int, ...], pipe: Any = None) -> dict[str, Any]:
        """One source of the output's aspect as the engine encodes it: its VAE copy at `image_areas`' VAE area
        (`copy_sizes`, ~1 MP whatever the output's size: 4,096 packed tokens after the 1,024 generated at 512 x 512;
        a tiny build's own area), in latents of `pipe.vae_scale_factor` (`pipe`: the plan's `config_pipe`, its
        `name_or_path` the checkpoint, or a loaded pipeline)."""
        if pipe is None:
            raise TypeError(f"model family {self.name!r}: the example source's size needs the pipeline (`pipe`)")
        c, h, w = (int(x) for x in latent_shape[-3:])
        scale = int(pipe.vae_scale_factor)
        _, (vw, vh) = self.copy_sizes(pipe, w * scale, h * scale)
        tokens = (vh // scale // 2) * (vw // scale // 2)
        return {"ref_tokens": ((tokens, 4 * c), None), "ref_grid": ((1, 2), "float32")}

    # ---- validation --------------------------------------------------------------------------------------------
    def check_settings(self, res: Any, job: Any) -> None:
        super().check_settings(res, job)
        name = str(res["hf_checkpoint"] or "").rstrip("/").rpartition("/")[2].lower()
        if name == "qwen-image-edit":
            res.fail(
                f"{res.show('hf_checkpoint')}: the first Qwen-Image-Edit runs `QwenImageEditPipeline` (one source at "
                f"1 MP for both copies, its own template), not the Plus path of model family {self.name!r}; use "
                "Qwen-Image-Edit-2509 or -2511"
            )
