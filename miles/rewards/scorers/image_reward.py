"""The ImageReward v1.0 reward (Xu et al. 2023, "ImageReward: Learning and Evaluating Human Preferences for
Text-to-Image Generation", arXiv 2304.05977; THUDM/ImageReward `ImageReward.py`).

    v     = ViT(image)                                       BLIP ViT-L/16 at 224, all tokens after the final norm
    h     = BERT(input_ids, attention_mask, cross-attending to v)[:, 0]     the text [CLS] feature
    score = (MLP(h) - 0.16717362830052426) / 1.0333394966054072
    MLP   = Linear(768, 1024) Dropout(0.2) Linear(1024, 128) Dropout(0.2) Linear(128, 64) Dropout(0.1)
            Linear(64, 16) Linear(16, 1)                    (no activations, as published; dropouts off at eval)

as `ImageReward.score` / `inference_rank` compute it (flow_grpo's `imagereward` reward calls `inference_rank`): the
prompt is tokenized by BLIP's BERT tokenizer (bert-base-uncased; padded and truncated to 35 tokens), the [CLS]
token is kept (not replaced by [ENC]), and the image mask is all ones. Typical scores are about -2 to 2 (the
mean/std are those of the authors' reference set).

No `image-reward` package at run time: the checkpoint (`ImageReward.pt`, the `ImageReward` module's state dict:
`blip.visual_encoder.*`, `blip.text_encoder.*`, `mlp.layers.{0,2,4,6,7}.*`; other `blip.*` heads such as
`vision_proj`/`text_proj` are not used) maps onto transformers' BLIP classes (`image_reward_to_hf`):

    blip.visual_encoder (BLIP's timm-style ViT)   -> `BlipVisionModel` (cls_token, pos_embed, patch_embed.proj,
        blocks.N.{norm1, attn.qkv, attn.proj, norm2, mlp.fc1, mlp.fc2}, norm renamed; LayerNorm eps 1e-6, GELU);
        its `last_hidden_state` is BLIP's `visual_encoder(image)`
    blip.text_encoder (BLIP's med.py BertModel)   -> `BlipTextModel(add_pooling_layer=False)` built with
        `is_decoder=True` (so every layer has its cross-attention, as med.py's `add_cross_attention`) and called
        with `is_decoder=False` (a bidirectional mask, med.py's "multimodal" mode); the key names are the same

Sizes are read from the shapes (vision width/patch/grid/depth, text vocab/width/positions/depth, cross-attention
width); head counts default to width / 64 (ViT-L: 16, BERT-base: 12). Preprocessing is ImageReward's `_transform`:
Resize(224, bicubic), CenterCrop(224), ToTensor, Normalize(OpenAI CLIP mean/std) (`clip_score.clip_pixels`).

Forwards run in chunks of `batch_size` images under a lock; a video sample, (F, 3, H, W), is scored on `num_frames`
uniformly spaced frames (all when None) and the frame scores are averaged.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from miles.rewards.scorers._model import model_scorer
from miles.rewards.scorers.aesthetic import aesthetic_mlp
from miles.rewards.scorers.clip_score import (
    ChunkedFrameScorer,
    clip_pixels,
    count_numbered,
    load_state_dict,
    module_from_state_dict,
)

if TYPE_CHECKING:
    from miles.rewards.dispatch import RewardSettings, Scorer

IMAGE_REWARD_MEAN = 0.16717362830052426
IMAGE_REWARD_STD = 1.0333394966054072
TEXT_MAX_LENGTH = 35  # ImageReward tokenizes prompts to 35 tokens
VISION_LAYER_NORM_EPS = 1e-6  # BLIP's ViT: partial(nn.LayerNorm, eps=1e-6)
TEXT_LAYER_NORM_EPS = 1e-12  # BLIP's med_config.json (bert-base)

_VISION_RENAMES = (
    ("norm1.", "layer_norm1."),
    ("norm2.", "layer_norm2."),
    ("attn.qkv.", "self_attn.qkv."),
    ("attn.proj.", "self_attn.projection."),
    ("mlp.fc1.", "mlp.fc1."),
    ("mlp.fc2.", "mlp.fc2."),
)


def _count(state: Mapping[str, Any], prefix: str) -> int:
    return count_numbered(state, prefix, "layers", "the ImageReward state dict")


def image_reward_to_hf(
    state: Mapping[str, Any],
    *,
    vision_heads: int | None = None,
    text_heads: int | None = None,
    pad_token_id: int = 0,
    sep_token_id: int | None = None,
    bos_token_id: int | None = None,
) -> tuple[Any, Any, dict[str, Any], dict[str, Any], dict[str, Any]]:
    """ImageReward's state dict -> (`BlipVisionConfig`, `BlipTextConfig`, the `BlipVisionModel` state dict, the
    `BlipTextModel` state dict, the MLP head's state dict (`layers.N.*`)). The special token ids (the tokenizer's;
    unused by the encoder forward) go into the text config. Raises ValueError on a key outside `blip.*` and
    `mlp.*`, or on a missing one."""
    from transformers import BlipTextConfig, BlipVisionConfig

    vis, txt = "blip.visual_encoder.", "blip.text_encoder."
    unknown = sorted(k for k in state if not (k.startswith("blip.") or k.startswith("mlp.")))
    if unknown:
        raise ValueError(f"{len(unknown)} keys are not ImageReward's (blip.*, mlp.*): {', '.join(unknown[:5])}")

    def need(key: str) -> Any:
        if key not in state:
            raise ValueError(f"the ImageReward state dict has no {key!r}")
        return state[key]

    vision: dict[str, Any] = {}
    for key, value in state.items():
        if not key.startswith(vis):
            continue
        rest = key[len(vis) :]
        if rest == "cls_token":
            vision["embeddings.class_embedding"] = value
        elif rest == "pos_embed":
            vision["embeddings.position_embedding"] = value
        elif rest.startswith("patch_embed.proj."):
            vision["embeddings.patch_embedding." + rest.removeprefix("patch_embed.proj.")] = value
        elif rest.startswith("norm."):
            vision["post_layernorm." + rest.removeprefix("norm.")] = value
        elif m := re.match(r"blocks\.(\d+)\.(.*)", rest):
            inner = m.group(2)
            for a, b in _VISION_RENAMES:
                if inner.startswith(a):
                    vision[f"encoder.layers.{m.group(1)}.{b}{inner.removeprefix(a)}"] = value
                    break
            else:
                raise ValueError(f"unexpected ViT key {key!r}")
        else:
            raise ValueError(f"unexpected ViT key {key!r}")

    # med.py keeps position_ids as a (persistent) buffer; BlipTextModel rebuilds it
    text = {k[len(txt) :]: v for k, v in state.items() if k.startswith(txt) and not k.endswith("position_ids")}
    text = {k: v for k, v in text.items() if not k.startswith("pooler.")}
    mlp = {k.removeprefix("mlp."): v for k, v in state.items() if k.startswith("mlp.")}

    patch = need(vis + "patch_embed.proj.weight")  # (width, 3, patch, patch)
    v_width, patch_size = int(patch.shape[0]), int(patch.shape[-1])
    positions = int(need(vis + "pos_embed").shape[1])
    grid = math.isqrt(positions - 1)
    if grid * grid + 1 != positions:
        raise ValueError(f"pos_embed has {positions} positions, not a square grid plus one")
    vision_config = BlipVisionConfig(
        hidden_size=v_width,
        intermediate_size=int(need(vis + "blocks.0.mlp.fc1.weight").shape[0]),
        num_hidden_layers=_count(state, vis + "blocks."),
        num_attention_heads=vision_heads or max(1, v_width // 64),
        image_size=grid * patch_size,
        patch_size=patch_size,
        hidden_act="gelu",
        layer_norm_eps=VISION_LAYER_NORM_EPS,
    )
    words = need(txt + "embeddings.word_embeddings.weight")  # (vocab, width)
    t_width = int(words.shape[1])
    text_config = BlipTextConfig(
        vocab_size=int(words.shape[0]),
        hidden_size=t_width,
        encoder_hidden_size=int(need(txt + "encoder.layer.0.crossattention.self.key.weight").shape[1]),
        intermediate_size=int(need(txt + "encoder.layer.0.intermediate.dense.weight").shape[0]),
        num_hidden_layers=_count(state, txt + "encoder.layer."),
        num_attention_heads=text_heads or max(1, t_width // 64),
        max_position_embeddings=int(need(txt + "embeddings.position_embeddings.weight").shape[0]),
        hidden_act="gelu",
        layer_norm_eps=TEXT_LAYER_NORM_EPS,
        is_decoder=True,  # builds the cross-attention of every layer; forwards pass is_decoder=False
        pad_token_id=pad_token_id,
        sep_token_id=sep_token_id,
        bos_token_id=bos_token_id,
    )
    if int(need("mlp.layers.0.weight").shape[1]) != t_width:
        raise ValueError(
            f"mlp.layers.0 takes {need('mlp.layers.0.weight').shape[1]} features, the text width is {t_width}"
        )
    return vision_config, text_config, vision, text, mlp


class ImageRewardScorer(ChunkedFrameScorer):
    """ImageReward v1.0 (BLIP ViT + cross-attending BERT + MLP) in transformers' BLIP classes."""

    def __init__(
        self,
        model_path: str,
        tokenizer_path: str,
        batch_size: int = 8,
        num_frames: int | None = None,
        device: str | None = None,
        vision_heads: int | None = None,
        text_heads: int | None = None,
    ) -> None:
        super().__init__(batch_size, num_frames, device)
        from transformers import AutoTokenizer, BlipTextModel, BlipVisionModel

        self.tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path))
        pad = self.tokenizer.pad_token_id
        vision_config, text_config, vision, text, mlp = image_reward_to_hf(
            load_state_dict(model_path, "the ImageReward state dict"),
            vision_heads=vision_heads,
            text_heads=text_heads,
            pad_token_id=0 if pad is None else int(pad),
            sep_token_id=self.tokenizer.sep_token_id,
            bos_token_id=self.tokenizer.bos_token_id,
        )
        if len(self.tokenizer) > text_config.vocab_size:
            raise ValueError(
                f"the tokenizer at {tokenizer_path} has {len(self.tokenizer)} tokens but the ImageReward text encoder "
                f"has {text_config.vocab_size}: use BLIP's tokenizer (bert-base-uncased)"
            )
        self.vision = module_from_state_dict(lambda: BlipVisionModel(vision_config), vision).eval().to(self.device)
        self.text = (
            module_from_state_dict(lambda: BlipTextModel(text_config, add_pooling_layer=False), text)
            .eval()
            .to(self.device)
        )
        self.mlp = aesthetic_mlp(text_config.hidden_size)
        self.mlp.load_state_dict(mlp, strict=True)
        self.mlp = self.mlp.eval().to(self.device)
        for module in (self.vision, self.text, self.mlp):
            module.requires_grad_(False)
        self.image_size = int(vision_config.image_size)

    def _score_chunk(self, images: list[np.ndarray], prompts: list[str]) -> list[float]:
        import torch

        text = self.tokenizer(
            prompts, padding="max_length", truncation=True, max_length=TEXT_MAX_LENGTH, return_tensors="pt"
        ).to(self.device)
        pixels = clip_pixels(images, self.image_size).to(self.device, dtype=self.vision.dtype)
        with torch.no_grad():
            image_embeds = self.vision(pixel_values=pixels).last_hidden_state
            image_atts = torch.ones(image_embeds.shape[:-1], dtype=torch.long, device=self.device)
            out = self.text(
                input_ids=text.input_ids,
                attention_mask=text.attention_mask,
                encoder_hidden_states=image_embeds,
                encoder_attention_mask=image_atts,
                is_decoder=False,
                use_cache=False,
            )
            features = out.last_hidden_state[:, 0, :].float()
            scores = (self.mlp.layers(features).squeeze(-1) - IMAGE_REWARD_MEAN) / IMAGE_REWARD_STD
        return [float(s) for s in scores.cpu()]


@functools.lru_cache(maxsize=2)
def load_image_reward(
    model_path: str, tokenizer_path: str, batch_size: int = 8, num_frames: int | None = None
) -> ImageRewardScorer:
    """A process-wide ImageReward scorer per (checkpoint, tokenizer, batch size, frames)."""
    return ImageRewardScorer(str(model_path), str(tokenizer_path), batch_size=int(batch_size), num_frames=num_frames)


def build(settings: RewardSettings) -> Scorer:
    """`--rm-type image_reward`."""
    return model_scorer(
        load_image_reward(settings.get("image_reward_model_path"), settings.get("image_reward_tokenizer_path"))
    )
