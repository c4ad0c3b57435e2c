"""Offline tokenizer for tiny-qwen-image: a byte-level BPE `Qwen2Tokenizer` laid out from a fixed corpus.

The corpus is tiny-sd3's prompt corpus wrapped in QwenImagePipeline's own prompt template (read from the
installed diffusers). Qwen's own pre-tokenizer splits it into pre-tokens, and greedy BPE (ties broken on
the pair itself, so every run gives the same merges) merges until every pre-token is one symbol. So the
template's system prefix tokenizes to exactly `prompt_template_encode_start_idx` (34) tokens, as with
the real Qwen vocab, and the pipeline's drop removes all of it and nothing else.

Vocab layout (Qwen's): the 256 byte symbols (GPT-2 order), one entry per merge, then the special tokens.
Unseen text falls back to byte symbols (byte-level BPE has no unk). Building takes milliseconds once
transformers is imported.
"""

from __future__ import annotations

import re
from collections import Counter
from functools import lru_cache
from typing import Any

from miles.models.tiny.tokenizers import byte_alphabet, greedy_merges, prompt_corpus

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
VISION_PAD = "<|vision_pad|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
# Qwen2.5-VL's special tokens, in the hub tokenizer's id order
SPECIAL_TOKENS = (
    ENDOFTEXT,
    IM_START,
    IM_END,
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    VISION_START,
    VISION_END,
    VISION_PAD,
    IMAGE_PAD,
    VIDEO_PAD,
)
MODEL_MAX_LENGTH = 32768
NEGATIVE_PROMPTS = (" ", "")  # the empty negative prompts diffusers/sglang callers send
# names of the ids `token_ids` returns -> their tokens
_ID_NAMES = {
    "endoftext_id": ENDOFTEXT,
    "im_start_id": IM_START,
    "im_end_id": IM_END,
    "vision_start_id": VISION_START,
    "vision_end_id": VISION_END,
    "image_token_id": IMAGE_PAD,
    "video_token_id": VIDEO_PAD,
}


@lru_cache(maxsize=1)
def qwen_image_prompt_template() -> tuple[str, int]:
    """(`prompt_template_encode`, `prompt_template_encode_start_idx`) of the installed QwenImagePipeline.

    Both are set in the pipeline's `__init__`, so this builds an empty pipeline (no components) to read them.
    """
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=None, transformer=None)
    return pipe.prompt_template_encode, int(pipe.prompt_template_encode_start_idx)


def template_prefix(template: str) -> str:
    """The part of the template the pipeline drops: everything before the prompt slot."""
    return template.split("{}", 1)[0]


def tokenizer_corpus(template: str) -> list[str]:
    """The texts the merges are learned from: every corpus prompt (and the empty negatives) in the template."""
    return [template.format(p) for p in (*prompt_corpus(), *NEGATIVE_PROMPTS)]


def qwen_pre_tokenizer() -> Any:
    """Qwen2Tokenizer's own pre-tokenizer (regex split, then byte-level symbols), taken from an empty one."""
    from transformers import Qwen2Tokenizer

    return Qwen2Tokenizer(vocab={ENDOFTEXT: 0}, merges=[])._tokenizer.pre_tokenizer


def pre_tokenize(texts: list[str], pre_tokenizer: Any) -> Counter[str]:
    """Counts of the byte-level pre-tokens of `texts`, with special tokens cut out first (as the tokenizer does)."""
    specials = re.compile("|".join(re.escape(s) for s in SPECIAL_TOKENS))
    counts: Counter[str] = Counter()
    for text in texts:
        for chunk in specials.split(text):
            if chunk:
                counts.update(piece for piece, _ in pre_tokenizer.pre_tokenize_str(chunk))
    return counts


def learn_merges(counts: Counter[str]) -> list[tuple[str, str]]:
    """Greedy BPE over the pre-tokens until each is one symbol; ties break on the pair (deterministic)."""
    return greedy_merges({w: tuple(w) for w in counts}, counts)


def build_qwen_tokenizer(template: str | None = None) -> Any:
    """A `Qwen2Tokenizer` whose merges are learned from `tokenizer_corpus(template)` (default: the pipeline's).

    eos = pad = unk = `<|endoftext|>` (Qwen's defaults), no bos; every Qwen2.5-VL special token is in the
    vocab and registered as special, so it is never split.
    """
    from transformers import Qwen2Tokenizer

    if template is None:
        template, _ = qwen_image_prompt_template()
    merges = learn_merges(pre_tokenize(tokenizer_corpus(template), qwen_pre_tokenizer()))
    vocab: dict[str, int] = {}
    for tok in (*byte_alphabet(), *("".join(m) for m in merges), *SPECIAL_TOKENS):
        vocab.setdefault(tok, len(vocab))
    return Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,  # a list of tuples: `tokenizers` rejects "a b" strings (TypeError)
        unk_token=ENDOFTEXT,
        eos_token=ENDOFTEXT,
        pad_token=ENDOFTEXT,
        extra_special_tokens=[t for t in SPECIAL_TOKENS if t != ENDOFTEXT],
        model_max_length=MODEL_MAX_LENGTH,
    )


def token_ids(tokenizer: Any) -> dict[str, int]:
    """The ids the Qwen2.5-VL config needs: vocab size and the special ids."""
    ids = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in _ID_NAMES.items()}
    ids["vocab_size"] = len(tokenizer)
    return ids
