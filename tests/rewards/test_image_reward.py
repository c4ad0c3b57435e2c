"""The ImageReward v1.0 reward (`scorers.image_reward`): a tiny checkpoint in ImageReward.pt's layout written by hand
(random tensors under BLIP's `blip.visual_encoder.*` / `blip.text_encoder.*` names plus the `mlp.layers.*` head and the
unused `vision_proj`/`text_proj`), loaded into transformers' BLIP classes, and checked against BLIP's forward written
out in plain torch (timm-style ViT; med.py BERT with cross-attention; [CLS] -> MLP -> (x - mean) / std)."""

from __future__ import annotations

import asyncio

import pytest
import torch
import torch.nn.functional as F
from reward_helpers import attention, eval_pixels, gelu, layer_norm, linear, noise_image, random_tensors

from miles.config.resolution import schema_args
from miles.core.sample import Sample
from miles.rewards.dispatch import batched_async_rm
from miles.rewards.scorers.image_reward import (
    IMAGE_REWARD_MEAN,
    IMAGE_REWARD_STD,
    image_reward_to_hf,
    load_image_reward,
)

V_WIDTH, V_HEADS, V_MLP, PATCH, GRID, V_LAYERS = 192, 3, 256, 8, 4, 2  # heads: the width / 64 default
T_WIDTH, T_HEADS, T_MLP, T_LAYERS, T_POSITIONS = 128, 2, 256, 2, 40
PROMPTS = ["a photo of a cat", "a photo of a dog", "a handwritten digit three", "a blank image", "the number seven"]
VIS, TXT = "blip.visual_encoder.", "blip.text_encoder."


def bert_vocab() -> dict[str, int]:
    words = sorted({w for p in PROMPTS for w in p.split()})
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words, *letters, *(f"##{c}" for c in letters)]
    return {t: i for i, t in enumerate(dict.fromkeys(tokens))}


def checkpoint_state(vocab: int) -> dict[str, torch.Tensor]:
    shapes: dict[str, tuple[int, ...]] = {
        VIS + "cls_token": (1, 1, V_WIDTH),
        VIS + "pos_embed": (1, GRID * GRID + 1, V_WIDTH),
        VIS + "patch_embed.proj.weight": (V_WIDTH, 3, PATCH, PATCH),
        VIS + "patch_embed.proj.bias": (V_WIDTH,),
        VIS + "norm.weight": (V_WIDTH,),
        VIS + "norm.bias": (V_WIDTH,),
        TXT + "embeddings.word_embeddings.weight": (vocab, T_WIDTH),
        TXT + "embeddings.position_embeddings.weight": (T_POSITIONS, T_WIDTH),
        TXT + "embeddings.LayerNorm.weight": (T_WIDTH,),
        TXT + "embeddings.LayerNorm.bias": (T_WIDTH,),
        "blip.vision_proj.weight": (16, V_WIDTH),  # BLIP_Pretrain's contrastive heads: in the file, not used
        "blip.text_proj.weight": (16, T_WIDTH),
    }
    for i in range(V_LAYERS):
        p = f"{VIS}blocks.{i}."
        for name, shape in {
            "norm1": (V_WIDTH,),
            "norm2": (V_WIDTH,),
            "attn.qkv": (3 * V_WIDTH, V_WIDTH),
            "attn.proj": (V_WIDTH, V_WIDTH),
            "mlp.fc1": (V_MLP, V_WIDTH),
            "mlp.fc2": (V_WIDTH, V_MLP),
        }.items():
            shapes[p + name + ".weight"] = shape
            shapes[p + name + ".bias"] = (shape[0],)
    for i in range(T_LAYERS):
        p = f"{TXT}encoder.layer.{i}."
        for name, shape in {
            "attention.self.query": (T_WIDTH, T_WIDTH),
            "attention.self.key": (T_WIDTH, T_WIDTH),
            "attention.self.value": (T_WIDTH, T_WIDTH),
            "attention.output.dense": (T_WIDTH, T_WIDTH),
            "attention.output.LayerNorm": (T_WIDTH,),
            "crossattention.self.query": (T_WIDTH, T_WIDTH),
            "crossattention.self.key": (T_WIDTH, V_WIDTH),
            "crossattention.self.value": (T_WIDTH, V_WIDTH),
            "crossattention.output.dense": (T_WIDTH, T_WIDTH),
            "crossattention.output.LayerNorm": (T_WIDTH,),
            "intermediate.dense": (T_MLP, T_WIDTH),
            "output.dense": (T_WIDTH, T_MLP),
            "output.LayerNorm": (T_WIDTH,),
        }.items():
            shapes[p + name + ".weight"] = shape
            shapes[p + name + ".bias"] = (shape[0],)
    sizes = (T_WIDTH, 1024, 128, 64, 16, 1)
    for index, fan_in, fan_out in zip((0, 2, 4, 6, 7), sizes, sizes[1:], strict=False):
        shapes[f"mlp.layers.{index}.weight"] = (fan_out, fan_in)
        shapes[f"mlp.layers.{index}.bias"] = (fan_out,)
    state = random_tensors(shapes, seed=11, scale=0.1)
    state[TXT + "embeddings.position_ids"] = torch.arange(T_POSITIONS).unsqueeze(0)  # med.py's persistent buffer
    return state


@pytest.fixture(scope="module")
def image_reward_checkpoint(tmp_path_factory) -> tuple[str, str, dict[str, torch.Tensor]]:
    """-> (ImageReward.pt path, BERT tokenizer dir, the state dict)."""
    from transformers import BertTokenizer

    root = tmp_path_factory.mktemp("image_reward")
    vocab = bert_vocab()
    BertTokenizer(vocab=vocab).save_pretrained(root / "tokenizer")
    state = checkpoint_state(len(vocab))
    torch.save(state, root / "ImageReward.pt")
    return str(root / "ImageReward.pt"), str(root / "tokenizer"), state


def hand_image_reward(sd: dict, tokenizer_dir: str, images: list[torch.Tensor], prompts: list[str]) -> list[float]:
    """ImageReward.score: BLIP ViT -> med.py BERT (self-attn, cross-attn to all image tokens, FFN; post-LN) ->
    [CLS] -> MLP (affine) -> (x - mean) / std."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    text = tokenizer(prompts, padding="max_length", truncation=True, max_length=35, return_tensors="pt")
    assert (text.input_ids[:, 0] == tokenizer.cls_token_id).all()  # [CLS] first, as BLIP's BERT tokenizer puts it
    pixels = torch.stack([eval_pixels(im, GRID * PATCH) for im in images])
    b = len(images)
    x = F.conv2d(pixels, sd[VIS + "patch_embed.proj.weight"], sd[VIS + "patch_embed.proj.bias"], stride=PATCH)
    x = torch.cat([sd[VIS + "cls_token"].expand(b, -1, -1), x.flatten(2).transpose(1, 2)], dim=1)
    x = x + sd[VIS + "pos_embed"]
    for i in range(V_LAYERS):
        p = f"{VIS}blocks.{i}."
        h = layer_norm(x, sd[p + "norm1.weight"], sd[p + "norm1.bias"], 1e-6)
        q, k, v = linear(h, sd[p + "attn.qkv.weight"], sd[p + "attn.qkv.bias"]).chunk(3, dim=-1)
        x = x + linear(attention(q, k, v, V_HEADS), sd[p + "attn.proj.weight"], sd[p + "attn.proj.bias"])
        h = layer_norm(x, sd[p + "norm2.weight"], sd[p + "norm2.bias"], 1e-6)
        h = gelu(linear(h, sd[p + "mlp.fc1.weight"], sd[p + "mlp.fc1.bias"]))
        x = x + linear(h, sd[p + "mlp.fc2.weight"], sd[p + "mlp.fc2.bias"])
    image = layer_norm(x, sd[VIS + "norm.weight"], sd[VIS + "norm.bias"], 1e-6)

    def lin(h: torch.Tensor, name: str) -> torch.Tensor:
        return linear(h, sd[name + ".weight"], sd[name + ".bias"])

    def ln(h: torch.Tensor, name: str) -> torch.Tensor:
        return layer_norm(h, sd[name + ".weight"], sd[name + ".bias"], 1e-12)

    ids = text.input_ids
    h = (
        sd[TXT + "embeddings.word_embeddings.weight"][ids]
        + sd[TXT + "embeddings.position_embeddings.weight"][: ids.shape[1]]
    )
    h = ln(h, TXT + "embeddings.LayerNorm")
    mask = (1.0 - text.attention_mask[:, None, None, :].float()) * -10000.0  # med.py's extended mask
    for i in range(T_LAYERS):
        p = f"{TXT}encoder.layer.{i}."
        a = attention(
            lin(h, p + "attention.self.query"),
            lin(h, p + "attention.self.key"),
            lin(h, p + "attention.self.value"),
            T_HEADS,
            mask,
        )
        h = ln(lin(a, p + "attention.output.dense") + h, p + "attention.output.LayerNorm")
        c = attention(
            lin(h, p + "crossattention.self.query"),
            lin(image, p + "crossattention.self.key"),
            lin(image, p + "crossattention.self.value"),
            T_HEADS,
        )
        h = ln(lin(c, p + "crossattention.output.dense") + h, p + "crossattention.output.LayerNorm")
        f = gelu(lin(h, p + "intermediate.dense"))
        h = ln(lin(f, p + "output.dense") + h, p + "output.LayerNorm")
    y = h[:, 0]
    for index in (0, 2, 4, 6, 7):
        y = lin(y, f"mlp.layers.{index}")
    return ((y.squeeze(-1) - 0.16717362830052426) / 1.0333394966054072).tolist()


@pytest.mark.slow
def test_image_reward_tiny_random_weights(image_reward_checkpoint):
    path, tokenizer_dir, state = image_reward_checkpoint
    images = [noise_image(50 + i, 40, 48) for i in range(4)] + [noise_image(60, 32, 32)]
    expected = hand_image_reward(state, tokenizer_dir, images, PROMPTS)

    scorer = load_image_reward(path, tokenizer_dir, batch_size=2)
    scores = scorer.score(images, PROMPTS)
    assert scores == pytest.approx(expected, abs=1e-5)
    assert len(set(scores)) == 5
    assert (IMAGE_REWARD_MEAN, IMAGE_REWARD_STD) == (0.16717362830052426, 1.0333394966054072)
    # the score depends on the prompt through the cross-attending text encoder
    other = scorer.score(images[:1], ["a photo of a dog"])
    assert other[0] != pytest.approx(scores[0], abs=1e-6)
    # a video: the mean of its frames' scores
    (video,) = scorer.score([torch.stack(images[:2])], [PROMPTS[0]])
    per_frame = hand_image_reward(state, tokenizer_dir, images[:2], [PROMPTS[0]] * 2)
    assert video == pytest.approx(sum(per_frame) / 2, abs=1e-5)


def test_image_reward_converter_reads_sizes_and_refuses_strays():
    state = checkpoint_state(vocab=100)
    vision, text, v_state, t_state, mlp = image_reward_to_hf(state)
    assert (vision.hidden_size, vision.num_attention_heads, vision.image_size, vision.patch_size) == (192, 3, 32, 8)
    assert (vision.num_hidden_layers, vision.intermediate_size, vision.layer_norm_eps) == (2, V_MLP, 1e-6)
    assert (text.hidden_size, text.num_attention_heads, text.encoder_hidden_size, text.vocab_size) == (
        128,
        2,
        192,
        100,
    )
    assert (text.num_hidden_layers, text.max_position_embeddings, text.is_decoder) == (2, T_POSITIONS, True)
    assert torch.equal(
        v_state["encoder.layers.1.self_attn.projection.weight"], state[VIS + "blocks.1.attn.proj.weight"]
    )
    assert "embeddings.position_ids" not in t_state and sorted(mlp)[0] == "layers.0.bias"
    with pytest.raises(ValueError, match="not ImageReward's"):
        image_reward_to_hf({**state, "extra.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="unexpected ViT key"):
        image_reward_to_hf({**state, VIS + "blocks.0.ls1.gamma": torch.zeros(1)})


@pytest.mark.slow
def test_image_reward_flags_reach_the_dispatch_tiny_random_weights(image_reward_checkpoint):
    """A job's --image-reward-model-path (ImageReward.pt) and --image-reward-tokenizer-path (the BERT tokenizer): the
    dispatch scores with them, as `load_image_reward` with the same paths does, and as BLIP's forward by hand."""
    path, tokenizer_dir, state = image_reward_checkpoint
    images = [noise_image(90 + i, 40, 48) for i in range(3)]
    samples = [Sample(index=i, group_index=0, prompt=PROMPTS[i], image=im) for i, im in enumerate(images)]
    args = schema_args(
        rm_type=["image_reward"], image_reward_model_path=path, image_reward_tokenizer_path=tokenizer_dir
    )
    got = asyncio.run(batched_async_rm(args, samples))
    assert got == load_image_reward(path, tokenizer_dir).score(images, PROMPTS[:3])
    assert got == pytest.approx(hand_image_reward(state, tokenizer_dir, images, PROMPTS[:3]), abs=1e-5)
    assert len(set(got)) == 3
