"""Reward models and reward placement."""

from __future__ import annotations

from miles.config.catalog._common import flag_maker
from miles.config.flags import BOOL, DOTTED, ENUM, FLOAT, INT, PATH, STR, Flag

GROUP = "Reward"
_f = flag_maker(GROUP)

RM_TYPES = ("digit", "ocr", "pickscore", "jpeg_compressibility", "jpeg_incompressibility", "remote_rm")

FLAGS: list[Flag] = [
    _f(
        "rm-type",
        ENUM,
        None,
        "Built-in reward model; a sample's metadata.rm_type overrides it.",
        choices=RM_TYPES,
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
]
