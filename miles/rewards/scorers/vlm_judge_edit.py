"""The VLM judge of an edit, EditReward-style (TIGER-AI-Lab/EditReward: two heads, instruction following and visual
quality, rated 1-4 from the source, the edited image and the instruction): the same OpenAI-compatible chat server as
`vlm_judge` (`--vlm-judge-url`, `--vlm-judge-model`) sees the source and the edited image and rates the edit twice.

    vlm_judge_edit = (1 - w) * (F - 1) / (N - 1) + w * (Q - 1) / (N - 1)        in [0, 1]

with F the instruction-following rating, Q the quality rating, both on 1..N (`--vlm-judge-edit-max-score`, default 4
as EditReward's rubrics), and w = `--vlm-judge-edit-quality-weight` (default 0.5: the mean of the two). A rating of
1 maps to 0, N to 1. Instruction following includes "changes nothing it was not asked to" (EditReward's
over-editing criterion), so an edit that ignores the instruction and one that repaints the whole image both lose it.

Each (sample, frame) is one POST `{url}/v1/chat/completions` whose user message holds, in order, every condition
image of the prompt row (the source first, then any references), the edited image (each a PNG `image_url` part, as
`vlm_judge` sends it) and the text of `--vlm-judge-edit-prompt-template` (`{prompt}` is the instruction, `{max_score}`
N). The default template asks for two lines, `Instruction following: N` and `Quality: N`. The answer is parsed
leniently: each rating is the number after its label and a colon (or `=`), in any case, with markdown bold, a
`_`-joined JSON key (`"instruction_following": 3`), a "score" word or a parenthesised scale (`Quality (1-4): 3`)
around it; when a label appears several times the last one counts (a judge that reasons first ends with its
verdict). A missing rating, or one outside [1, N], raises ValueError quoting the answer.

A video sample is judged on `--vlm-judge-num-frames` uniformly spaced frames (all when unset), each against the
sources, and the frame rewards are averaged. Retries, timeouts and concurrency are `vlm_judge`'s.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from miles.rewards.scorers._source import sourced_scorer
from miles.rewards.scorers.clip_score import sample_frames
from miles.rewards.scorers.jpeg import image_to_uint8
from miles.rewards.scorers.vlm_judge import (
    ANSWER_QUOTE,
    VlmJudge,
    answer_text,
    format_max_score,
    frame_means,
    png_data_url,
    render_prompt,
    run_coroutine,
)
from miles.utils.text import clip

if TYPE_CHECKING:
    from miles.rewards.dispatch import RewardSettings, Scorer

DEFAULT_EDIT_PROMPT_TEMPLATE = (
    "You are an expert judge of image edits.\n"
    "The last image is the result of editing the image(s) before it (the source first) with the instruction: "
    '"{prompt}"\n'
    "Rate the edit on two scales from 1 to {max_score}.\n"
    "Instruction following: does the edited image carry out the instruction accurately and completely, and change "
    "nothing the instruction did not ask for? 1 means ignored or wrong; {max_score} means fully and precisely done.\n"
    "Quality: is the edited image plausible, natural and free of artifacts, consistent with the source in lighting "
    "and style? 1 means broken; {max_score} means flawless.\n"
    "Answer with exactly two lines:\n"
    "Instruction following: N\n"
    "Quality: N"
)
DEFAULT_EDIT_MAX_SCORE = 4.0
DEFAULT_QUALITY_WEIGHT = 0.5
_AFTER_LABEL = r"""(?:[\s_-]*score)?(?:\s*\([^)\n]*\))?[\s*_"']*[:=][\s*_"']*(\d+(?:\.\d+)?)"""
FOLLOWING_PATTERN = re.compile(r"(?i)instruction[\s_-]*following" + _AFTER_LABEL)
QUALITY_PATTERN = re.compile(r"(?i)(?:visual[\s_-]*)?quality" + _AFTER_LABEL)


def _last_rating(answer: str, pattern: re.Pattern[str], what: str, max_score: float) -> float:
    matches = pattern.findall(answer)
    quoted = clip(answer.strip(), ANSWER_QUOTE)
    if not matches:
        raise ValueError(f"the VLM judge's answer has no {what} rating ('{what.capitalize()}: N'): {quoted!r}")
    value = float(matches[-1])
    if not 1.0 <= value <= max_score:
        raise ValueError(
            f"the VLM judge's {what} rating {value:g} is outside [1, {format_max_score(max_score)}] "
            f"(--vlm-judge-edit-max-score); answer: {quoted!r}"
        )
    return value


def parse_edit_scores(answer: str, max_score: float) -> tuple[float, float]:
    """(instruction following, quality) ratings of the judge's answer, each in [1, max_score]; ValueError quoting
    the answer when one is missing or out of range."""
    following = _last_rating(answer, FOLLOWING_PATTERN, "instruction following", max_score)
    quality = _last_rating(answer, QUALITY_PATTERN, "quality", max_score)
    return following, quality


def edit_reward(following: float, quality: float, max_score: float, quality_weight: float) -> float:
    """(1 - w) * (F - 1) / (N - 1) + w * (Q - 1) / (N - 1)."""
    span = max_score - 1.0
    return (1.0 - quality_weight) * (following - 1.0) / span + quality_weight * (quality - 1.0) / span


class VlmEditJudge(VlmJudge):
    """A chat-completions VLM judging edits: `score(images, sources, prompts)` (sync) or `ascore` (the coroutine)."""

    def __init__(
        self,
        url: str,
        model: str | None = None,
        prompt_template: str = DEFAULT_EDIT_PROMPT_TEMPLATE,
        max_score: float = DEFAULT_EDIT_MAX_SCORE,
        quality_weight: float = DEFAULT_QUALITY_WEIGHT,
        **kwargs: Any,
    ) -> None:
        if not float(max_score) > 1:
            raise ValueError(f"the edit judge's max_score must be above 1 (ratings are 1..N), got {max_score}")
        if not 0.0 <= float(quality_weight) <= 1.0:
            raise ValueError(f"quality_weight must be in [0, 1], got {quality_weight}")
        super().__init__(url, model, prompt_template, max_score=float(max_score), **kwargs)
        self.quality_weight = float(quality_weight)

    async def _judge_edit(
        self, session: Any, semaphore: Any, sources: list[np.ndarray], frame: np.ndarray, prompt: str
    ) -> float:
        images = [*sources, frame]
        content: list[dict[str, Any]] = [
            {"type": "image_url", "image_url": {"url": png_data_url(im)}} for im in images
        ]
        content.append({"type": "text", "text": render_prompt(self.prompt_template, prompt, self.max_score)})
        body = {
            "model": await self._model_name(session, semaphore),
            "messages": [{"role": "user", "content": content}],
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
        }
        reply = await self._request(session, semaphore, "POST", self.endpoint, body)
        following, quality = parse_edit_scores(answer_text(reply), self.max_score)
        return edit_reward(following, quality, self.max_score, self.quality_weight)

    async def ascore_edits(
        self, images: Sequence[Any], sources: Sequence[Sequence[Any]], prompts: Sequence[str]
    ) -> list[float]:
        if not len(images) == len(sources) == len(prompts):
            raise ValueError(f"{len(images)} images, {len(sources)} source lists and {len(prompts)} prompts")
        frames = [sample_frames(image, self.num_frames) for image in images]
        jobs = []
        for per_sample, per_sources, prompt in zip(frames, sources, prompts, strict=True):
            if not per_sources:
                raise ValueError("no source image (the prompt row has no condition image)")
            source_frames = [image_to_uint8(s) for s in per_sources]
            jobs += [(source_frames, frame, str(prompt)) for frame in per_sample]
        return frame_means(await self._judge_all(self._judge_edit, jobs), [len(f) for f in frames])

    def score_edits(
        self, images: Sequence[Any], sources: Sequence[Sequence[Any]], prompts: Sequence[str]
    ) -> list[float]:
        return run_coroutine(self.ascore_edits(images, sources, prompts))


@functools.lru_cache(maxsize=4)
def load_vlm_edit_judge(
    url: str,
    model: str | None = None,
    prompt_template: str = DEFAULT_EDIT_PROMPT_TEMPLATE,
    max_score: float = DEFAULT_EDIT_MAX_SCORE,
    quality_weight: float = DEFAULT_QUALITY_WEIGHT,
    num_frames: int | None = None,
    max_concurrency: int = 8,
    timeout: float = 120.0,
    max_retries: int = 3,
    backoff: float = 1.0,
) -> VlmEditJudge:
    """A process-wide edit judge per settings."""
    return VlmEditJudge(
        url,
        model,
        prompt_template,
        float(max_score),
        float(quality_weight),
        num_frames=num_frames,
        max_concurrency=max_concurrency,
        timeout=timeout,
        max_retries=max_retries,
        backoff=backoff,
    )


def build(settings: RewardSettings) -> Scorer:
    """`--rm-type vlm_judge_edit`."""
    judge = load_vlm_edit_judge(
        settings.get("vlm_judge_url"),
        settings.get("vlm_judge_model"),
        settings.get("vlm_judge_edit_prompt_template", DEFAULT_EDIT_PROMPT_TEMPLATE),
        float(settings.get("vlm_judge_edit_max_score", DEFAULT_EDIT_MAX_SCORE)),
        float(settings.get("vlm_judge_edit_quality_weight", DEFAULT_QUALITY_WEIGHT)),
        settings.get("vlm_judge_num_frames"),
        int(settings.get("vlm_judge_max_concurrency", 8)),
    )

    def score(
        images: list[Any], prompts: list[str], metadata: list[Mapping[str, Any]], sources: list[list[Any]]
    ) -> list[float]:
        return judge.score_edits(images, sources, prompts)

    return sourced_scorer(score, "vlm_judge_edit", judge.device)
