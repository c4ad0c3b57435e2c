"""The HPSv2 reward (`scorers.hps`): a tiny open_clip-format checkpoint written by hand (random tensors under
open_clip's key names, saved under "state_dict" with DDP's "module." prefix), loaded through the key converter into a
transformers `CLIPModel`, and checked against open_clip's forward written out in plain torch: cos(image, text)."""

from __future__ import annotations

import asyncio

import pytest
import torch
import torch.nn.functional as F
from reward_helpers import attention, eval_pixels, gelu, layer_norm, linear, noise_image, normalized, random_tensors

from miles.config.resolution import schema_args
from miles.core.sample import Sample
from miles.rewards.dispatch import batched_async_rm
from miles.rewards.scorers.hps import default_text_heads, default_vision_heads, load_hps, open_clip_to_hf

VISION_WIDTH, TEXT_WIDTH, EMBED, PATCH, GRID, LAYERS, MLP, CONTEXT = 128, 128, 32, 8, 4, 2, 256, 77
HEADS = 2  # 128 / 64: open_clip's head width 64, the converter's default for these widths
PROMPTS = ["a photo of a cat", "a photo of a dog", "a handwritten digit 3", "a blank image", "the number 7"]


def block_shapes(prefix: str, width: int) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(LAYERS):
        p = f"{prefix}{i}."
        shapes |= {
            p + "ln_1.weight": (width,),
            p + "ln_1.bias": (width,),
            p + "attn.in_proj_weight": (3 * width, width),
            p + "attn.in_proj_bias": (3 * width,),
            p + "attn.out_proj.weight": (width, width),
            p + "attn.out_proj.bias": (width,),
            p + "ln_2.weight": (width,),
            p + "ln_2.bias": (width,),
            p + "mlp.c_fc.weight": (MLP, width),
            p + "mlp.c_fc.bias": (MLP,),
            p + "mlp.c_proj.weight": (width, MLP),
            p + "mlp.c_proj.bias": (width,),
        }
    return shapes


def open_clip_state(vocab: int) -> dict[str, torch.Tensor]:
    shapes = {
        "visual.conv1.weight": (VISION_WIDTH, 3, PATCH, PATCH),
        "visual.class_embedding": (VISION_WIDTH,),
        "visual.positional_embedding": (GRID * GRID + 1, VISION_WIDTH),
        "visual.ln_pre.weight": (VISION_WIDTH,),
        "visual.ln_pre.bias": (VISION_WIDTH,),
        **block_shapes("visual.transformer.resblocks.", VISION_WIDTH),
        "visual.ln_post.weight": (VISION_WIDTH,),
        "visual.ln_post.bias": (VISION_WIDTH,),
        "visual.proj": (VISION_WIDTH, EMBED),
        "token_embedding.weight": (vocab, TEXT_WIDTH),
        "positional_embedding": (CONTEXT, TEXT_WIDTH),
        **block_shapes("transformer.resblocks.", TEXT_WIDTH),
        "ln_final.weight": (TEXT_WIDTH,),
        "ln_final.bias": (TEXT_WIDTH,),
        "text_projection": (TEXT_WIDTH, EMBED),
        "logit_scale": (),
    }
    return random_tensors(shapes, seed=7, scale=0.1)


@pytest.fixture(scope="module")
def hps_checkpoint(tmp_path_factory) -> tuple[str, str, dict[str, torch.Tensor]]:
    """-> (checkpoint path, tokenizer dir, the open_clip state dict)."""
    from miles.models.tiny.tokenizers import build_clip_tokenizer

    root = tmp_path_factory.mktemp("hps")
    tokenizer = build_clip_tokenizer()
    tokenizer.save_pretrained(root / "tokenizer")
    state = open_clip_state(len(tokenizer))
    torch.save({"epoch": 1, "state_dict": {f"module.{k}": v for k, v in state.items()}}, root / "HPS_v2.1_tiny.pt")
    return str(root / "HPS_v2.1_tiny.pt"), str(root / "tokenizer"), state


def open_clip_tower(x: torch.Tensor, sd: dict, prefix: str, causal: bool) -> torch.Tensor:
    """open_clip's Transformer: pre-LN residual blocks, nn.MultiheadAttention (in_proj = [q; k; v]), GELU MLP."""
    length = x.shape[1]
    mask = torch.full((length, length), float("-inf")).triu(1) if causal else None
    for i in range(LAYERS):
        p = f"{prefix}{i}."
        h = layer_norm(x, sd[p + "ln_1.weight"], sd[p + "ln_1.bias"], 1e-5)
        q, k, v = linear(h, sd[p + "attn.in_proj_weight"], sd[p + "attn.in_proj_bias"]).chunk(3, dim=-1)
        x = x + linear(attention(q, k, v, HEADS, mask), sd[p + "attn.out_proj.weight"], sd[p + "attn.out_proj.bias"])
        h = layer_norm(x, sd[p + "ln_2.weight"], sd[p + "ln_2.bias"], 1e-5)
        h = gelu(linear(h, sd[p + "mlp.c_fc.weight"], sd[p + "mlp.c_fc.bias"]))
        x = x + linear(h, sd[p + "mlp.c_proj.weight"], sd[p + "mlp.c_proj.bias"])
    return x


def hand_hps(sd: dict, tokenizer_dir: str, images: list[torch.Tensor], prompts: list[str]) -> list[float]:
    """HPSv2's img_score: diag(normalize(encode_image) @ normalize(encode_text).T), open_clip's forward."""
    from transformers import CLIPTokenizer

    ids = CLIPTokenizer.from_pretrained(tokenizer_dir)(
        prompts, padding="max_length", truncation=True, max_length=CONTEXT, return_tensors="pt"
    ).input_ids
    pixels = torch.stack([eval_pixels(im, GRID * PATCH) for im in images])
    b = len(images)
    x = F.conv2d(pixels, sd["visual.conv1.weight"], stride=PATCH).flatten(2).transpose(1, 2)
    x = torch.cat([sd["visual.class_embedding"].expand(b, 1, -1), x], dim=1) + sd["visual.positional_embedding"]
    x = layer_norm(x, sd["visual.ln_pre.weight"], sd["visual.ln_pre.bias"], 1e-5)
    x = open_clip_tower(x, sd, "visual.transformer.resblocks.", causal=False)
    image = layer_norm(x[:, 0], sd["visual.ln_post.weight"], sd["visual.ln_post.bias"], 1e-5) @ sd["visual.proj"]
    t = sd["token_embedding.weight"][ids] + sd["positional_embedding"]
    t = open_clip_tower(t, sd, "transformer.resblocks.", causal=True)
    t = layer_norm(t, sd["ln_final.weight"], sd["ln_final.bias"], 1e-5)
    text = t[torch.arange(b), ids.argmax(dim=-1)] @ sd["text_projection"]  # pooled at <|endoftext|> (highest id)
    return (normalized(image) * normalized(text)).sum(-1).tolist()


@pytest.mark.slow
def test_hps_tiny_random_weights(hps_checkpoint):
    path, tokenizer_dir, state = hps_checkpoint
    images = [noise_image(30 + i, 48, 40) for i in range(4)] + [noise_image(40, 32, 32)]
    expected = hand_hps(state, tokenizer_dir, images, PROMPTS)

    scorer = load_hps(path, tokenizer_dir, batch_size=2)
    scores = scorer.score(images, PROMPTS)
    assert scores == pytest.approx(expected, abs=1e-5)
    assert len(set(scores)) == 5 and all(-1 <= s <= 1 for s in scores)
    assert scorer.image_size == 32 and scorer.context_length == CONTEXT
    # a video: frames 0 and 2 of 3, averaged
    frames = torch.stack(images[:3])
    per_frame = hand_hps(state, tokenizer_dir, list(frames), [PROMPTS[0]] * 3)
    (video,) = load_hps(path, tokenizer_dir, num_frames=2).score([frames], [PROMPTS[0]])
    assert video == pytest.approx((per_frame[0] + per_frame[2]) / 2, abs=1e-5)


def test_open_clip_converter_reads_sizes_and_refuses_strays():
    state = open_clip_state(vocab=300)
    ids = {"eos_token_id": 299, "bos_token_id": 298}
    config, hf = open_clip_to_hf(state, **ids)
    vision, text = config.vision_config, config.text_config
    assert (vision.hidden_size, vision.patch_size, vision.image_size, vision.num_hidden_layers) == (128, 8, 32, 2)
    assert (vision.num_attention_heads, vision.intermediate_size, vision.hidden_act) == (2, MLP, "gelu")
    assert (text.vocab_size, text.max_position_embeddings, text.num_attention_heads, text.eos_token_id) == (
        300,
        CONTEXT,
        2,
        299,
    )
    assert config.projection_dim == EMBED
    k = state["visual.transformer.resblocks.1.attn.in_proj_weight"].chunk(3)[1]
    assert torch.equal(hf["vision_model.encoder.layers.1.self_attn.k_proj.weight"], k)
    assert torch.equal(hf["text_projection.weight"], state["text_projection"].T)
    assert torch.equal(hf["visual_projection.weight"], state["visual.proj"].T)
    assert default_vision_heads(1280) == 16 and default_vision_heads(1024) == 16 and default_text_heads(1024) == 16

    assert "attn_mask" not in hf  # open_clip's causal-mask buffer is ignored, an unknown key is not
    open_clip_to_hf({**state, "attn_mask": torch.zeros(CONTEXT, CONTEXT)}, **ids)
    with pytest.raises(ValueError, match=r"1 open_clip keys have no place.*visual\.extra"):
        open_clip_to_hf({**state, "visual.extra": torch.zeros(1)}, **ids)
    with pytest.raises(ValueError, match=r"no 'ln_final\.weight'"):
        open_clip_to_hf({k: v for k, v in state.items() if k != "ln_final.weight"}, **ids)


@pytest.mark.slow
def test_hps_flags_reach_the_dispatch_tiny_random_weights(hps_checkpoint):
    """A job's --hps-model-path (the open_clip checkpoint) and --hps-tokenizer-path: the dispatch scores with them,
    as `load_hps` with the same paths does, and as open_clip's forward on that checkpoint and tokenizer."""
    path, tokenizer_dir, state = hps_checkpoint
    images = [noise_image(80 + i, 40, 48) for i in range(3)]
    samples = [Sample(index=i, group_index=0, prompt=PROMPTS[i], image=im) for i, im in enumerate(images)]
    args = schema_args(rm_type=["hpsv2"], hps_model_path=path, hps_tokenizer_path=tokenizer_dir)
    got = asyncio.run(batched_async_rm(args, samples))
    assert got == load_hps(path, tokenizer_dir).score(images, PROMPTS[:3])
    assert got == pytest.approx(hand_hps(state, tokenizer_dir, images, PROMPTS[:3]), abs=1e-5)
    assert len(set(got)) == 3
