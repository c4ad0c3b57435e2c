"""Offline tokenizer for tiny-cosmos3: a byte-level BPE `Qwen2Tokenizer` with a Qwen-style chat template.

Cosmos3 has no text encoder: its language model reads token ids, which `Cosmos3OmniPipeline.tokenize_prompt`
makes with the tokenizer's chat template (system prompt, then the prompt with the resolution / duration
sentences appended), then `<eos>` and `<|vision_start|>`. The merges are learned, as for tiny-qwen-image,
from that exact text (every digit prompt in the image and video templates), so a digit prompt's chat is a
few dozen tokens; unseen text falls back to byte symbols.
"""

from __future__ import annotations

from typing import Any

from miles.models.qwen_image.tokenizer import (
    ENDOFTEXT,
    IM_END,
    IM_START,
    MODEL_MAX_LENGTH,
    SPECIAL_TOKENS,
    learn_merges,
    pre_tokenize,
    qwen_pre_tokenizer,
)
from miles.models.tiny.tokenizers import byte_alphabet, prompt_corpus

# Qwen's chat layout (`<|im_start|>role\ncontent<|im_end|>\n` per message, then the assistant's header)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    + IM_START
    + "{{ message['role'] }}\n{{ message['content'] }}"
    + IM_END
    + "\n{% endfor %}{% if add_generation_prompt %}"
    + IM_START
    + "assistant\n{% endif %}"
)


def _chat(system: str, user: str) -> str:
    return f"{IM_START}system\n{system}{IM_END}\n{IM_START}user\n{user}{IM_END}\n{IM_START}assistant\n"


def tokenizer_corpus(sizes: tuple[int, ...], frames: tuple[int, ...], fps: tuple[float, ...]) -> list[str]:
    """Every corpus prompt and the empty negative, through the pipeline's image and video templates, in chat form,
    at the given sizes / frame counts / frame rates."""
    from diffusers.pipelines.cosmos import pipeline_cosmos3_omni as module

    from miles.data.digits_video import DIRECTIONS
    from miles.data.digits_video import prompt_for as video_prompt

    # the sentences `Cosmos3OmniPipeline.__init__` sets as its templates (diffusers 0.42), filled in
    prompts = [*prompt_corpus(), *(video_prompt(k, d) for k in range(10) for d in DIRECTIONS), ""]
    texts: list[str] = []
    for size in sizes:
        image = (f"This image is of {size}x{size} resolution.", f"This image is not of {size}x{size} resolution.")
        video = (f"This video is of {size}x{size} resolution.", f"This video is not of {size}x{size} resolution.")
        for p in prompts:
            for sentence in image:
                texts.append(_chat(module._SYSTEM_PROMPT_IMAGE, _append(p, sentence)))
            for n in frames:
                for rate in fps:
                    for dur, sentence in zip(
                        (
                            f"The video is {n / rate:.1f} seconds long and is of {rate:.0f} FPS.",
                            f"The video is not {n / rate:.1f} seconds long and is not of {rate:.0f} FPS.",
                        ),
                        video,
                        strict=True,
                    ):
                        texts.append(_chat(module._SYSTEM_PROMPT_VIDEO, _append(_append(p, dur), sentence)))
    return texts


def _append(base: str, addition: str) -> str:
    """`Cosmos3OmniPipeline.tokenize_prompt`'s sentence join."""
    base = base.rstrip(".")
    return f"{base}. {addition}" if base else addition


def build_cosmos3_tokenizer(sizes: tuple[int, ...], frames: tuple[int, ...], fps: tuple[float, ...]) -> Any:
    """A `Qwen2Tokenizer` (eos = pad = `<|endoftext|>`, every Qwen2.5-VL special token, `<|vision_start|>`
    included) with `CHAT_TEMPLATE`, its merges learned from `tokenizer_corpus(...)`."""
    from transformers import Qwen2Tokenizer

    merges = learn_merges(pre_tokenize(tokenizer_corpus(sizes, frames, fps), qwen_pre_tokenizer()))
    vocab: dict[str, int] = {}
    for tok in (*byte_alphabet(), *("".join(m) for m in merges), *SPECIAL_TOKENS):
        vocab.setdefault(tok, len(vocab))
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=ENDOFTEXT,
        eos_token=ENDOFTEXT,
        pad_token=ENDOFTEXT,
        extra_special_tokens=[t for t in SPECIAL_TOKENS if t != ENDOFTEXT],
        model_max_length=MODEL_MAX_LENGTH,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
