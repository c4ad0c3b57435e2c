"""The reward types: one table keyed by the `--rm-type` value users type, as `miles.methods` is for training methods.
Torch-free (the config layer reads it before torch is loaded).

Every reader of a reward type goes through it: the flag's choices (`miles.config.catalog.reward`), the rule on the
flags each type needs (`miles.config.rules.data`), the preflight's model paths and prompt-line checks
(`miles.preflight`), the placement of GPU reward workers (`miles.placement.plan`), which types score on Ray actor
pools (`miles.rewards.pool`) and the scorer each type builds (`miles.rewards.dispatch`, loaded from `build`). A new
reward is one entry here plus its module under `miles/rewards/scorers/`, its flags and its tests.

This module, the face of the package `miles.rewards`, sits on the ground floor (it imports nothing of miles); the
rest of the package (`dispatch.py`, `pool.py`, `errors.py`, `scorers/`, `service/`) sits on a floor of its own, above
the config and below the rollout (tests/test_import_layers.py).

A job scores one reward type or several: `--rm-type digit,jpeg_compressibility` (weight 1 each) or
`--reward-weights digit=1,jpeg_compressibility=0.2` (or a YAML mapping); `reward_components(args)` reads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RewardType:
    """One `--rm-type`.

    build: `module:function(settings) -> scorer(images, prompts, metadata) -> list[float]`, the in-process scorer
        (None: a type that is not scored by a built-in scorer, `remote_rm` scores through its client); a sourced
        type's scorer is `scorer(images, prompts, metadata, sources=...)`.
    required: flags (dests) the type cannot score without; the config refuses a job that misses one.
    model_paths: (dest, kind) of the local files it loads (kind as `miles.preflight.models` checks them:
        clip_model, clip_processor, file, dir); the preflight checks each exists before anything starts.
    pooled: it scores on Ray actor pools by default (a model that loads once per worker).
    workers_flag: the flag (dest) giving its pool's worker count (None: one worker).
    gpu_flag: the flag (dest) giving GPUs per worker (None: CPU workers); only PickScore's workers sit in the
        placement plan's reward slots today.
    needs: what it reads of a prompt line beyond the prompt: `label` (metadata.label 0-9), `quoted` (a quoted
        target in the prompt), `source` (the row's condition images, `Sample.sources`: a type that scores an edit
        against its source; the dispatch passes them to its scorer as `sources=`, one list per sample, and refuses a
        sample without one), `direction` (metadata.direction: right, left, down or up).
    gold: it may serve as `--gold-rm-type` (a reward computed in-process on the eval samples).
    """

    name: str
    summary: str
    build: str | None
    required: tuple[str, ...] = ()
    model_paths: tuple[tuple[str, str], ...] = ()
    pooled: bool = False
    workers_flag: str | None = None
    gpu_flag: str | None = None
    needs: tuple[str, ...] = ()
    gold: bool = True

    @property
    def sourced(self) -> bool:
        """It scores an edit against its source: its scorer takes `sources=` (each sample's condition images)."""
        return "source" in self.needs


_SCORERS = "miles.rewards.scorers"

REWARD_TYPES: dict[str, RewardType] = {
    t.name: t
    for t in (
        RewardType(
            "digit",
            "the embedded digit classifier's probability of metadata.label",
            f"{_SCORERS}.digit:build",
            needs=("label",),
        ),
        RewardType(
            "ocr",
            "RapidOCR (PP-OCRv4, ONNX, bundled): 1 - normalised edit distance to the prompt's quoted text",
            f"{_SCORERS}.ocr:build",
            pooled=True,
            workers_flag="ocr_num_workers",
            needs=("quoted",),
        ),
        RewardType(
            "pickscore",
            "PickScore (CLIP) text-image preference, /26",
            f"{_SCORERS}.pickscore:build",
            required=("pickscore_model_path", "pickscore_processor_path"),
            model_paths=(("pickscore_model_path", "clip_model"), ("pickscore_processor_path", "clip_processor")),
            pooled=True,
            workers_flag="pickscore_num_workers",
            gpu_flag="pickscore_num_gpus_per_worker",
        ),
        RewardType(
            "jpeg_compressibility",
            "minus the JPEG size in kB (flow_grpo's compressibility)",
            f"{_SCORERS}.jpeg:build_compressibility",
        ),
        RewardType(
            "jpeg_incompressibility",
            "the JPEG size in kB",
            f"{_SCORERS}.jpeg:build_incompressibility",
        ),
        RewardType(
            "clip_score",
            "CLIP text-image cosine x 100/30 (flow_grpo's clipscore), from a local CLIP folder",
            f"{_SCORERS}.clip_score:build",
            required=("clip_score_model_path",),
            model_paths=(("clip_score_model_path", "clip_model"), ("clip_score_processor_path", "clip_processor")),
            pooled=True,
        ),
        RewardType(
            "aesthetic",
            "the LAION aesthetic predictor v2 (an MLP on CLIP ViT-L/14 image embeddings), 1-10",
            f"{_SCORERS}.aesthetic:build",
            required=("aesthetic_model_path", "aesthetic_clip_path"),
            model_paths=(("aesthetic_model_path", "file"), ("aesthetic_clip_path", "clip_model")),
            pooled=True,
        ),
        RewardType(
            "hpsv2",
            "HPSv2 / v2.1 (an OpenCLIP ViT-H-14 checkpoint, loaded without open_clip): image-text cosine",
            f"{_SCORERS}.hps:build",
            required=("hps_model_path", "hps_tokenizer_path"),
            model_paths=(("hps_model_path", "file"), ("hps_tokenizer_path", "tokenizer")),
            pooled=True,
        ),
        RewardType(
            "image_reward",
            "ImageReward v1.0 (BLIP + MLP head), standardised as the original",
            f"{_SCORERS}.image_reward:build",
            required=("image_reward_model_path", "image_reward_tokenizer_path"),
            model_paths=(("image_reward_model_path", "file"), ("image_reward_tokenizer_path", "tokenizer")),
            pooled=True,
        ),
        RewardType(
            "vlm_judge",
            "a VLM behind an OpenAI chat API (your sglang or vLLM server): a 1-N rating parsed from its answer, / N",
            f"{_SCORERS}.vlm_judge:build",
            required=("vlm_judge_url",),
        ),
        # ---- an edit scored against its source (the prompt row's condition images, `Sample.sources`) ----
        RewardType(
            "clip_i",
            "CLIP-I: cos(E_I(edited), E_I(source)), how much of the source an edit keeps (the CLIP of clip_score)",
            f"{_SCORERS}.clip_i:build",
            required=("clip_score_model_path",),
            model_paths=(("clip_score_model_path", "clip_model"), ("clip_score_processor_path", "clip_processor")),
            pooled=True,
            needs=("source",),
        ),
        RewardType(
            "clip_directional",
            "CLIP directional similarity: cos(E_I(edited) - E_I(source), E_T(target caption) - E_T(source caption))",
            f"{_SCORERS}.clip_directional:build",
            required=("clip_score_model_path",),
            model_paths=(("clip_score_model_path", "clip_model"), ("clip_score_processor_path", "clip_processor")),
            pooled=True,
            needs=("source",),
        ),
        RewardType(
            "dino_i",
            "DINO-I: the cosine of DINOv2's CLS tokens of the edited image and its source",
            f"{_SCORERS}.dino_i:build",
            required=("dino_model_path",),
            model_paths=(("dino_model_path", "clip_model"),),
            pooled=True,
            needs=("source",),
        ),
        RewardType(
            "vlm_judge_edit",
            "a VLM judge of an edit (EditReward-style): instruction following and quality, 1-N each, from the source "
            "and the edited image; their weighted mean on [0, 1]",
            f"{_SCORERS}.vlm_judge_edit:build",
            required=("vlm_judge_url",),
            needs=("source",),
        ),
        RewardType(
            "digit_edit",
            "the digit edit task: p(metadata.label | edited) x how well it keeps the source digit's place and ink",
            f"{_SCORERS}.digit_edit:build",
            needs=("source", "label"),
        ),
        RewardType(
            "digit_i2v",
            "the digit image-to-video task: p(metadata.label) per frame x travel the prompted direction x how well "
            "the first frame keeps the condition frame",
            f"{_SCORERS}.digit_i2v:build",
            needs=("source", "label", "direction"),
        ),
        RewardType(
            "remote_rm",
            "any reward served by `miles reward serve` at --rm-url (HTTP, msgpack + PNG)",
            None,
            required=("rm_url",),
            gold=False,
        ),
    )
}

DEFAULT_WEIGHT = 1.0


def reward_type(name: str) -> RewardType:
    """The table's entry (KeyError naming the known types)."""
    try:
        return REWARD_TYPES[name]
    except KeyError:
        raise KeyError(f"unknown reward type {name!r}; known: {', '.join(REWARD_TYPES)}") from None


def reward_components(args: Any) -> tuple[tuple[str, float], ...]:
    """The job's rewards as ((type, weight), ...): `--reward-weights` when set, else each `--rm-type` with weight 1;
    () when neither is set (a custom reward, or none)."""
    weights = getattr(args, "reward_weights", None)
    if weights:
        return tuple((str(k), float(v)) for k, v in weights.items())
    types = getattr(args, "rm_type", None)
    if not types:
        return ()
    if isinstance(types, str):
        types = [types]
    return tuple((str(t), DEFAULT_WEIGHT) for t in types)


def reward_names(args: Any) -> list[str]:
    """The job's reward types, in order."""
    return [name for name, _ in reward_components(args)]


def is_multi_reward(args: Any) -> bool:
    """Several rewards, or weights given: each sample then carries its components (`Sample.reward_components`),
    logged per component, and its reward is their weighted sum."""
    return bool(getattr(args, "reward_weights", None)) or len(reward_components(args)) > 1
