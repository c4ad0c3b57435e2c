"""Offline tokenizers for tiny-sd3: a CLIP-style byte-level BPE and a T5-style Unigram, both laid
out by hand from a small fixed prompt corpus in milliseconds (deterministic: no trainer, no hashing).

The CLIP vocab is laid out like OpenAI CLIP's (256 bytes, the same with `</w>`, one entry per merge,
then `<|startoftext|>` and `<|endoftext|>`), so unseen words fall back to bytes and never map to unk.
"""

from __future__ import annotations

import re
from collections import Counter
from itertools import pairwise
from pathlib import Path

CLIP_MAX_LENGTH = 77  # sglang's native SD3 pipeline pads CLIP prompts to 77 positions
CLIP_BOS = "<|startoftext|>"
CLIP_EOS = "<|endoftext|>"
T5_SPECIALS = ("<pad>", "</s>", "<unk>")
T5_EXTRA_IDS = 10
T5_MODEL_MAX_LENGTH = 512

_DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


def prompt_corpus() -> list[str]:
    """The fixed training corpus: the digit prompts plus a few generic image-caption phrases."""
    lines = []
    for k, word in enumerate(_DIGIT_WORDS):
        lines += [
            f"a handwritten digit {k}",
            f"a handwritten digit {word}",
            f"the number {k}",
            f"the number {word}",
            f"a photo of the digit {k}",
            f"a drawing of a {word}",
            f"an image of a handwritten {word}",
        ]
    lines += [
        "a blank image",
        "a black background",
        "white strokes on a black background",
        "a photo of a cat",
        "a photo of a dog",
        "a small blurry picture",
        "a high quality image",
        "a bad low quality image",
        "handwriting sample from a form",
        "",
    ]
    return lines


def byte_alphabet() -> list[str]:
    """The 256 printable stand-ins for bytes, in GPT-2/CLIP order (bytes_to_unicode)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    codes = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return [chr(c) for c in codes]


def _clip_words(line: str) -> list[str]:
    """CLIP's pre-tokenization for ASCII text: lower-case, then letters runs, single digits, punctuation runs."""
    return re.findall(r"[a-z]+|[0-9]|[^\sa-z0-9]+", " ".join(line.lower().split()))


def learn_bpe_merges(corpus: list[str]) -> list[tuple[str, str]]:
    """Greedy BPE on the corpus words (with CLIP's `</w>` end marker) until every word is one symbol.

    Ties break on the pair itself, so the result is the same in every run (the `tokenizers`
    trainer breaks ties by hash order, which varies between runs).
    """
    counts = Counter(w for line in corpus for w in _clip_words(line))
    return greedy_merges({w: (*w[:-1], w[-1] + "</w>") for w in counts}, counts)


def greedy_merges(words: dict[str, tuple[str, ...]], counts: Counter[str]) -> list[tuple[str, str]]:
    """Greedy BPE: merge the most frequent adjacent pair (weighted by `counts`; ties broken on the pair) until
    every word of `words` (word -> its starting symbols) is one symbol. Deterministic."""
    words = dict(words)
    merges: list[tuple[str, str]] = []
    while True:
        pairs: Counter[tuple[str, str]] = Counter()
        for word, syms in words.items():
            for pair in pairwise(syms):
                pairs[pair] += counts[word]
        if not pairs:
            return merges
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        for word, syms in words.items():
            out: list[str] = []
            i = 0
            while i < len(syms):
                if i + 1 < len(syms) and (syms[i], syms[i + 1]) == best:
                    out.append(syms[i] + syms[i + 1])
                    i += 2
                else:
                    out.append(syms[i])
                    i += 1
            words[word] = tuple(out)


def build_clip_tokenizer(max_length: int = CLIP_MAX_LENGTH):
    """A `CLIPTokenizer` (fast) whose BPE merges are learned from `prompt_corpus()`."""
    from transformers import CLIPTokenizer

    merges = learn_bpe_merges(prompt_corpus())
    alphabet = byte_alphabet()
    tokens = alphabet + [c + "</w>" for c in alphabet] + ["".join(m) for m in merges] + [CLIP_BOS, CLIP_EOS]
    vocab: dict[str, int] = {}
    for tok in tokens:
        vocab.setdefault(tok, len(vocab))
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=max_length)


def build_t5_tokenizer(extra_corpus: list[str] | None = None):
    """A `T5Tokenizer` (fast) over a hand-laid Unigram vocab; pad 0, eos 1, unk 2.

    Pieces: the specials, every corpus word as `▁word` (log-frequency score), then every printable
    ASCII character alone and with `▁` (a low score), so known words are one token and any ASCII
    text still tokenizes; then T5's `<extra_id_*>` sentinels.

    `extra_corpus`: more lines whose words join the vocab (a video build adds its prompts); without it the
    vocab is tiny-sd3's.
    """
    import math
    from collections import Counter

    from transformers import T5Tokenizer

    counts = Counter(word for line in (*prompt_corpus(), *(extra_corpus or ())) for word in line.split())
    total = sum(counts.values())
    pieces: list[tuple[str, float]] = [(tok, 0.0) for tok in T5_SPECIALS]
    pieces.append(("\u2581", -2.0))
    pieces += [(f"\u2581{w}", math.log(counts[w] / total)) for w in sorted(counts)]
    known = {p for p, _ in pieces}
    for code in range(33, 127):
        for piece in (chr(code), "\u2581" + chr(code)):
            if piece not in known:
                pieces.append((piece, -12.0))
                known.add(piece)
    pieces += [(f"<extra_id_{i}>", 0.0) for i in range(T5_EXTRA_IDS - 1, -1, -1)]
    return T5Tokenizer(vocab=pieces, extra_ids=T5_EXTRA_IDS, model_max_length=T5_MODEL_MAX_LENGTH)


def save_tokenizers(out_dir: Path) -> dict[str, int]:
    """Write `tokenizer/`, `tokenizer_2/` (same CLIP BPE) and `tokenizer_3/` (T5) under `out_dir`.

    Returns the ids the text-encoder configs need: vocab sizes and the special ids.
    """
    clip = build_clip_tokenizer()
    t5 = build_t5_tokenizer()
    clip.save_pretrained(out_dir / "tokenizer")
    clip.save_pretrained(out_dir / "tokenizer_2")
    t5.save_pretrained(out_dir / "tokenizer_3")
    return {
        "clip_vocab_size": len(clip),
        "clip_bos_id": clip.convert_tokens_to_ids(CLIP_BOS),
        "clip_eos_id": clip.convert_tokens_to_ids(CLIP_EOS),
        "clip_pad_id": clip.pad_token_id,
        "t5_vocab_size": len(t5),
        "t5_pad_id": t5.pad_token_id,
        "t5_eos_id": t5.eos_token_id,
    }
