"""The scorers of the preference models (`--rm-type clip_score | aesthetic | hpsv2 | image_reward | vlm_judge`),
built from the job's Reward flags: what `miles.rewards.REWARD_TYPES` names as each type's `build`. Every model loads
from local files (nothing downloads); the formulas and their sources are in each model's module."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from miles.rewards.dispatch import RewardSettings, Scorer


def _wrap(model: Any) -> Scorer:
    """The model's `score(images, prompts)` as a dispatch scorer; a video sample `[3, F, H, W]` goes in frames
    first, the layout the model scorers read frames from."""
    from miles.rewards.dispatch import frames_first

    def score(images: Sequence[Any], prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]) -> list[float]:
        return model.score([frames_first(im) for im in images], list(prompts))

    score.device = getattr(model, "device", "cpu")  # type: ignore[attr-defined]
    return score


def clip_score_scorer(settings: RewardSettings) -> Scorer:
    from miles.rewards.scorers.clip_score import load_clip_score

    model = settings.get("clip_score_model_path")
    return _wrap(load_clip_score(model, settings.get("clip_score_processor_path"), settings.get("clip_score_scale")))


def aesthetic_scorer(settings: RewardSettings) -> Scorer:
    from miles.rewards.scorers.aesthetic import load_aesthetic

    return _wrap(load_aesthetic(settings.get("aesthetic_model_path"), settings.get("aesthetic_clip_path")))


def hpsv2_scorer(settings: RewardSettings) -> Scorer:
    from miles.rewards.scorers.hps import load_hps

    return _wrap(load_hps(settings.get("hps_model_path"), settings.get("hps_tokenizer_path")))


def image_reward_scorer(settings: RewardSettings) -> Scorer:
    from miles.rewards.scorers.image_reward import load_image_reward

    return _wrap(
        load_image_reward(settings.get("image_reward_model_path"), settings.get("image_reward_tokenizer_path"))
    )


def vlm_judge_scorer(settings: RewardSettings) -> Scorer:
    from miles.rewards.scorers import vlm_judge

    judge = vlm_judge.load_vlm_judge(
        settings.get("vlm_judge_url"),
        settings.get("vlm_judge_model"),
        settings.get("vlm_judge_prompt_template", vlm_judge.DEFAULT_PROMPT_TEMPLATE),
        settings.get("vlm_judge_score_pattern", vlm_judge.DEFAULT_SCORE_PATTERN),
        float(settings.get("vlm_judge_max_score", vlm_judge.DEFAULT_MAX_SCORE)),
        settings.get("vlm_judge_num_frames"),
        max_concurrency=int(settings.get("vlm_judge_max_concurrency", 8)),
    )
    return _wrap(judge)
