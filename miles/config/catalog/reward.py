"""Reward models and reward placement."""

from __future__ import annotations

from miles.config.catalog._common import flag_maker
from miles.config.flags import BOOL, DOTTED, ENUM, FLOAT, INT, PATH, STR, STR_LIST, WEIGHTS, Flag
from miles.rewards import REWARD_TYPES

GROUP = "Reward"
_f = flag_maker(GROUP)

RM_TYPES = tuple(REWARD_TYPES)
COMPONENT_NORMS = ("none", "group", "batch")

FLAGS: list[Flag] = [
    _f(
        "rm-type",
        STR_LIST,
        None,
        "Reward type(s); several (digit,jpeg_compressibility) are summed with weight 1 unless --reward-weights "
        "gives the weights. A sample's metadata.rm_type overrides it.",
        choices=RM_TYPES,
    ),
    _f(
        "reward-weights",
        WEIGHTS,
        None,
        "Several rewards and their weights, as name=w,name=w or a YAML mapping {digit: 1.0, ocr: 0.5}: the reward "
        "is the weighted sum, each component logged as rollout/reward/<name>/raw_mean.",
        choices=RM_TYPES,
    ),
    _f(
        "reward-component-norm",
        ENUM,
        "none",
        "Normalise each reward component before weighting, for the advantages: none (the weighted sum of raw "
        "scores, as flow_grpo), group (each component's z-score within its prompt group) or batch (within the "
        "rollout).",
        choices=COMPONENT_NORMS,
    ),
    _f("reward-key", STR, None, "Key of the reward used for training when the reward is a dict."),
    _f("group-rm", BOOL, False, "Score a whole prompt group in one call."),
    _f(
        "custom-rm-path",
        DOTTED,
        None,
        "Batched async reward function (args, samples) -> list[float], replacing the built-in dispatch.",
    ),
    _f(
        "custom-reward-post-process-path",
        DOTTED,
        None,
        "Function replacing the reward-to-advantage normalization.",
    ),
    _f(
        "colocate-reward",
        BOOL,
        False,
        "Place reward actors on the rollout GPUs with fractional shares. Requires --colocate.",
    ),
    _f("pickscore-model-path", PATH, None, "PickScore model (HF id or dir); required for --rm-type pickscore."),
    _f(
        "pickscore-processor-path",
        PATH,
        None,
        "PickScore CLIP processor (HF id or dir); required for --rm-type pickscore.",
    ),
    _f("pickscore-num-workers", INT, 1, "Number of PickScore reward actors.", min=1),
    _f("pickscore-num-gpus-per-worker", FLOAT, 1.0, "GPUs per PickScore actor; fractions allowed.", min=0),
    _f("pickscore-batch-size", INT, 8, "Images per PickScore forward.", min=1),
    _f("pickscore-num-frames", INT, None, "Video frames scored per sample; unset scores all frames.", min=1),
    _f("ocr-num-workers", INT, 4, "Number of OCR reward actors (CPU).", min=1),
    _f(
        "rollout-parser-num-workers",
        INT,
        1,
        "Ray actors that deserialize engine responses; raise it for large trajectory tensors.",
        min=1,
    ),
    _f("rm-url", STR, None, "URL of a remote reward service, read by --rm-type remote_rm or a custom reward."),
    _f(
        "rm-remote-name",
        STR,
        None,
        "The reward to ask the service at --rm-url for (default: the one it serves, when it serves one).",
    ),
    _f("rm-batch-size", INT, 32, "remote_rm: images per request to the reward service.", min=1),
    _f("rm-max-in-flight", INT, 4, "remote_rm: requests on the wire at once.", min=1),
    _f("rm-timeout", FLOAT, 60.0, "remote_rm: seconds one request may take before it is retried.", min=0.001),
    _f(
        "rm-retries",
        INT,
        3,
        "remote_rm: re-sends of a failed request (backoff 0.5 s, doubling) before the job ends.",
        min=0,
    ),
    _f(
        "rm-fault-wait",
        FLOAT,
        120.0,
        "remote_rm under --use-fault-tolerance: seconds a service that went down is waited for before the job ends.",
        min=0,
    ),
    _f(
        "clip-score-model-path",
        PATH,
        None,
        "CLIP model folder for --rm-type clip_score, clip_i and clip_directional (clip-vit-large-patch14).",
    ),
    _f("clip-score-processor-path", PATH, None, "Its CLIPProcessor folder, when not the model folder."),
    _f(
        "clip-score-scale",
        FLOAT,
        100.0 / 30.0,
        "clip_score = scale x max(cos, 0): 100/30 is flow_grpo's, 100 torchmetrics' CLIPScore, 2.5 the paper's.",
        min=0,
    ),
    _f("dino-model-path", PATH, None, "DINOv2 folder (model and image processor, dinov2-base) for --rm-type dino_i."),
    _f(
        "source-reward-num-frames",
        INT,
        None,
        "clip_i, clip_directional, dino_i: video frames scored against the source per sample; unset: all.",
        min=1,
    ),
    _f("aesthetic-model-path", PATH, None, "The LAION aesthetic MLP (sac+logos+ava1-l14-linearMSE.pth)."),
    _f("aesthetic-clip-path", PATH, None, "CLIP ViT-L/14 folder (model and processor) the aesthetic MLP reads."),
    _f("hps-model-path", PATH, None, "HPSv2 / v2.1 open_clip checkpoint file (HPS_v2.1_compressed.pt)."),
    _f("hps-tokenizer-path", PATH, None, "A CLIP BPE tokenizer folder for --rm-type hpsv2."),
    _f("image-reward-model-path", PATH, None, "ImageReward v1.0 checkpoint file (ImageReward.pt)."),
    _f("image-reward-tokenizer-path", PATH, None, "A bert-base-uncased tokenizer folder for --rm-type image_reward."),
    _f("vlm-judge-url", STR, None, "Base URL of an OpenAI-compatible chat server (sglang, vLLM) for vlm_judge."),
    _f("vlm-judge-model", STR, None, "The judge's model name (default: the server's first /v1/models id)."),
    _f(
        "vlm-judge-prompt-template",
        STR,
        None,
        "The judge's instruction, with {prompt} and {max_score} (default: a 1-to-max rating of fidelity and quality).",
    ),
    _f("vlm-judge-score-pattern", STR, None, "Regex whose group 1 is the score (default: the number after 'Score:')."),
    _f("vlm-judge-max-score", FLOAT, 5.0, "The rating scale's top: the reward is the rating / this.", min=0.001),
    _f("vlm-judge-num-frames", INT, None, "Video frames judged per sample (one request each); unset: all.", min=1),
    _f("vlm-judge-max-concurrency", INT, 8, "Requests to the judge in flight at once.", min=1),
    _f(
        "vlm-judge-edit-prompt-template",
        STR,
        None,
        "vlm_judge_edit's instruction, with {prompt} and {max_score}; it must ask for 'Instruction following: N' "
        "and 'Quality: N' (default: EditReward's two 1-to-max rubrics).",
    ),
    _f(
        "vlm-judge-edit-max-score",
        FLOAT,
        4.0,
        "vlm_judge_edit: the top of both rating scales (1 to this); a rating r counts (r - 1) / (max - 1).",
        min=2,
    ),
    _f(
        "vlm-judge-edit-quality-weight",
        FLOAT,
        0.5,
        "vlm_judge_edit = (1 - w) x following + w x quality, each rating mapped to [0, 1].",
        min=0,
        max=1,
    ),
]
