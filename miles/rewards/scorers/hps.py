"""The HPSv2 / HPSv2.1 reward (Human Preference Score v2, Wu et al. 2023, arXiv 2306.09341).

    score = cos(image_emb, text_emb) = <i / ||i||, t / ||t||>

HPS is an OpenCLIP ViT-H-14 (laion2B-s32B-b79K) fine-tuned on human preferences; its `img_score.py` computes
`diag(image_features @ text_features.T)` with open_clip's L2-normalised features, i.e. the cosine above (no logit
scale). Typical values are 0.2-0.35; flow_grpo's `hpsv2_score` trains on them as they are.

No open_clip at run time (it needs torchvision): the checkpoint (`HPS_v2.1_compressed.pt` / `HPS_v2_compressed.pt`,
an open_clip state dict, possibly under "state_dict" and/or with a "module." prefix) is converted by
`open_clip_to_hf` into a transformers `CLIPModel` whose sizes are read from the tensor shapes (head counts are not
in the shapes: open_clip's ViT-H-14 uses 16 vision heads of width 80 and text heads of width 64, the defaults below,
overridable). The activation is GELU (ViT-H-14 is not a QuickGELU model). The text tower reads input_ids only:
open_clip uses a causal mask and no padding mask, and pools at the end-of-text token (the highest id, the first
`<|endoftext|>`), which is what `CLIPTextModel` does with `eos_token_id` set from the tokenizer.

Preprocessing is open_clip's eval transform: Resize(224, bicubic) of the shorter side, CenterCrop(224), ToTensor,
Normalize(OpenAI CLIP mean/std) (`clip_score.clip_pixels`; 224 is read from the checkpoint). Text: a local CLIP BPE
tokenizer folder (`--hps-tokenizer-path`; any CLIP tokenizer, e.g. laion/CLIP-ViT-H-14-laion2B-s32B-b79K's, which is
the OpenAI BPE open_clip uses), padded and truncated to the checkpoint's context length (77).

Forwards run in chunks of `batch_size` images under a lock; a video sample, (F, 3, H, W), is scored on `num_frames`
uniformly spaced frames (all when None) and the frame scores are averaged.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from miles.rewards.scorers._model import model_scorer
from miles.rewards.scorers.clip_score import (
    ChunkedFrameScorer,
    clip_pixels,
    count_numbered,
    load_state_dict,
    module_from_state_dict,
    projected,
)

if TYPE_CHECKING:
    from miles.rewards.dispatch import RewardSettings, Scorer

# open_clip's vision towers whose head width is not 64 (ViT-H-14: 80, ViT-g-14: 88, ViT-bigG-14: 104)
_VISION_HEADS_BY_WIDTH = {1280: 16, 1408: 16, 1664: 16}
_IGNORED_KEYS = ("attn_mask", "logit_bias")  # open_clip buffers/params a CLIPModel has no slot for


def default_vision_heads(width: int) -> int:
    return _VISION_HEADS_BY_WIDTH.get(width, max(1, width // 64))


def default_text_heads(width: int) -> int:
    return max(1, width // 64)


def _num_blocks(state: Mapping[str, Any], prefix: str) -> int:
    return count_numbered(state, prefix, "residual blocks", "the state dict")


def _convert_blocks(take: Callable[[str], Any], src: str, dst: str, layers: int, out: dict[str, Any]) -> None:
    """open_clip resblocks (ln_1, attn.in_proj_*, attn.out_proj, ln_2, mlp.c_fc, mlp.c_proj) -> CLIPEncoderLayer;
    `take(key)` reads (and marks as used) one source tensor."""
    for i in range(layers):
        s, d = f"{src}{i}.", f"{dst}{i}."
        q, k, v = take(s + "attn.in_proj_weight").chunk(3, dim=0)
        qb, kb, vb = take(s + "attn.in_proj_bias").chunk(3, dim=0)
        for name, weight, bias in (("q_proj", q, qb), ("k_proj", k, kb), ("v_proj", v, vb)):
            out[d + f"self_attn.{name}.weight"] = weight
            out[d + f"self_attn.{name}.bias"] = bias
        for a, b in (
            ("attn.out_proj", "self_attn.out_proj"),
            ("ln_1", "layer_norm1"),
            ("ln_2", "layer_norm2"),
            ("mlp.c_fc", "mlp.fc1"),
            ("mlp.c_proj", "mlp.fc2"),
        ):
            out[d + b + ".weight"] = take(s + a + ".weight")
            out[d + b + ".bias"] = take(s + a + ".bias")


def open_clip_to_hf(
    state: Mapping[str, Any],
    *,
    vision_heads: int | None = None,
    text_heads: int | None = None,
    hidden_act: str = "gelu",
    eos_token_id: int | None = None,
    bos_token_id: int | None = None,
) -> tuple[Any, dict[str, Any]]:
    """An open_clip CLIP state dict -> (a transformers `CLIPConfig`, a `CLIPModel` state dict).

    Sizes come from the shapes: vision width/patch (`visual.conv1.weight`), image size (the grid of
    `visual.positional_embedding`), MLP widths (`mlp.c_fc`), layer counts (the resblock indices), text vocab/context
    (`token_embedding`, `positional_embedding`), projection width (`text_projection`). In-projections are split into
    q/k/v; `text_projection` and `visual.proj` (used as `x @ P`) are transposed into Linear weights. The tokenizer's
    end-of-text id (`eos_token_id`, where the text tower pools; also the pad id) and start id go into the text config.
    Raises ValueError on a key it does not place (other than open_clip's `attn_mask`) or a missing one.
    """
    from transformers import CLIPConfig

    used: set[str] = set()

    def take(key: str) -> Any:
        if key not in state:
            raise ValueError(f"the open_clip state dict has no {key!r}")
        used.add(key)
        return state[key]

    out: dict[str, Any] = {}

    conv = take("visual.conv1.weight")  # (width, 3, patch, patch)
    v_width, patch = int(conv.shape[0]), int(conv.shape[-1])
    v_pos = take("visual.positional_embedding")  # (grid^2 + 1, width)
    grid = math.isqrt(int(v_pos.shape[0]) - 1)
    if grid * grid + 1 != int(v_pos.shape[0]):
        raise ValueError(f"visual.positional_embedding has {v_pos.shape[0]} rows, not a square grid plus one")
    v_layers = _num_blocks(state, "visual.transformer.resblocks.")
    v_proj = take("visual.proj")  # (width, embed)

    tok = take("token_embedding.weight")  # (vocab, width)
    t_pos = take("positional_embedding")  # (context, width)
    t_width = int(tok.shape[1])
    t_layers = _num_blocks(state, "transformer.resblocks.")
    if "text_projection.weight" in state:  # a Linear in some open_clip configs (already (embed, width))
        t_proj_weight = take("text_projection.weight")
    else:
        t_proj_weight = take("text_projection").t()  # (width, embed), used as x @ P
    embed = int(v_proj.shape[1])
    if int(t_proj_weight.shape[0]) != embed:
        raise ValueError(f"text_projection gives width {t_proj_weight.shape[0]} but visual.proj {embed}")

    text_config: dict[str, Any] = {
        "vocab_size": int(tok.shape[0]),
        "hidden_size": t_width,
        "intermediate_size": int(state["transformer.resblocks.0.mlp.c_fc.weight"].shape[0]),
        "num_hidden_layers": t_layers,
        "num_attention_heads": text_heads or default_text_heads(t_width),
        "max_position_embeddings": int(t_pos.shape[0]),
        "hidden_act": hidden_act,
        "layer_norm_eps": 1e-5,
        "projection_dim": embed,
    }
    if eos_token_id is not None:
        text_config.update(eos_token_id=int(eos_token_id), pad_token_id=int(eos_token_id))
    if bos_token_id is not None:
        text_config.update(bos_token_id=int(bos_token_id))
    vision_config = {
        "hidden_size": v_width,
        "intermediate_size": int(state["visual.transformer.resblocks.0.mlp.c_fc.weight"].shape[0]),
        "num_hidden_layers": v_layers,
        "num_attention_heads": vision_heads or default_vision_heads(v_width),
        "image_size": grid * patch,
        "patch_size": patch,
        "hidden_act": hidden_act,
        "layer_norm_eps": 1e-5,
        "projection_dim": embed,
    }
    config = CLIPConfig(text_config=text_config, vision_config=vision_config, projection_dim=embed)

    out["vision_model.embeddings.patch_embedding.weight"] = conv
    out["vision_model.embeddings.class_embedding"] = take("visual.class_embedding")
    out["vision_model.embeddings.position_embedding.weight"] = v_pos
    for a, b in (("visual.ln_pre", "vision_model.pre_layrnorm"), ("visual.ln_post", "vision_model.post_layernorm")):
        out[b + ".weight"], out[b + ".bias"] = take(a + ".weight"), take(a + ".bias")
    _convert_blocks(take, "visual.transformer.resblocks.", "vision_model.encoder.layers.", v_layers, out)
    out["visual_projection.weight"] = v_proj.t()

    out["text_model.embeddings.token_embedding.weight"] = tok
    out["text_model.embeddings.position_embedding.weight"] = t_pos
    _convert_blocks(take, "transformer.resblocks.", "text_model.encoder.layers.", t_layers, out)
    out["text_model.final_layer_norm.weight"] = take("ln_final.weight")
    out["text_model.final_layer_norm.bias"] = take("ln_final.bias")
    out["text_projection.weight"] = t_proj_weight
    out["logit_scale"] = take("logit_scale").reshape(())

    left = sorted(k for k in state if k not in used and k.rsplit(".", 1)[-1] not in _IGNORED_KEYS)
    if left:
        raise ValueError(f"{len(left)} open_clip keys have no place in a CLIPModel: {', '.join(left[:5])}")
    return config, {k: v.contiguous() for k, v in out.items()}


class HpsScorer(ChunkedFrameScorer):
    """An HPS (open_clip) checkpoint in a `CLIPModel` plus a CLIP tokenizer, scoring cos(image, text)."""

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
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path))
        config, state = open_clip_to_hf(
            load_state_dict(model_path, "an open_clip state dict"),
            vision_heads=vision_heads,
            text_heads=text_heads,
            eos_token_id=self.tokenizer.eos_token_id,
            bos_token_id=self.tokenizer.bos_token_id,
        )
        if len(self.tokenizer) > config.text_config.vocab_size:
            raise ValueError(
                f"the tokenizer at {tokenizer_path} has {len(self.tokenizer)} tokens but the HPS checkpoint's "
                f"vocabulary has {config.text_config.vocab_size}: use a CLIP (OpenAI BPE) tokenizer"
            )
        from transformers import CLIPModel

        self.model = module_from_state_dict(lambda: CLIPModel(config), state).eval().to(self.device)
        self.model.requires_grad_(False)
        self.image_size = int(config.vision_config.image_size)
        self.context_length = int(config.text_config.max_position_embeddings)

    def _score_chunk(self, images: list[np.ndarray], prompts: list[str]) -> list[float]:
        import torch

        ids = self.tokenizer(
            prompts, padding="max_length", truncation=True, max_length=self.context_length, return_tensors="pt"
        ).input_ids.to(self.device)
        pixels = clip_pixels(images, self.image_size).to(self.device, dtype=self.model.dtype)
        with torch.no_grad():
            text_emb = projected(self.model.get_text_features(input_ids=ids)).float()
            image_emb = projected(self.model.get_image_features(pixel_values=pixels)).float()
            text_emb = text_emb / text_emb.norm(dim=-1, keepdim=True).clamp_min(1e-12)
            image_emb = image_emb / image_emb.norm(dim=-1, keepdim=True).clamp_min(1e-12)
            scores = (image_emb * text_emb).sum(dim=-1)
        return [float(s) for s in scores.cpu()]


@functools.lru_cache(maxsize=2)
def load_hps(model_path: str, tokenizer_path: str, batch_size: int = 8, num_frames: int | None = None) -> HpsScorer:
    """A process-wide HPS scorer per (checkpoint, tokenizer, batch size, frames)."""
    return HpsScorer(str(model_path), str(tokenizer_path), batch_size=int(batch_size), num_frames=num_frames)


def build(settings: RewardSettings) -> Scorer:
    """`--rm-type hpsv2`."""
    return model_scorer(load_hps(settings.get("hps_model_path"), settings.get("hps_tokenizer_path")))
