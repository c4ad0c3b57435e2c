"""Prompt data and the batch knobs."""

from __future__ import annotations

from miles.config.catalog._common import DATASET_JOBS, flag_maker
from miles.config.flags import BOOL, DOTTED, ENUM, INT, PATH, STR, Flag

GROUP = "Data and batching"
_f = flag_maker(GROUP)

FLAGS: list[Flag] = [
    _f(
        "prompt-data",
        PATH,
        None,
        "Prompt data, by its extension: .jsonl (one JSON object a line), .txt (one prompt a line), .parquet, or a "
        "folder Dataset.save_to_disk wrote.",
    ),
    _f("input-key", STR, "input", "Key (column) holding the prompt text."),
    _f("metadata-key", STR, "metadata", "Key (column) holding the per-prompt metadata dict."),
    _f(
        "media-key",
        STR,
        "media",
        "Key (column) holding a row's condition media: a list of {role, image or video} objects, paths relative to "
        "the data file's folder.",
    ),
    _f(
        "chosen-key",
        STR,
        "chosen",
        "Offline DPO (train sft --loss-type dpo): JSONL key of a preference row's chosen image path.",
        jobs=DATASET_JOBS,
    ),
    _f(
        "rejected-key",
        STR,
        "rejected",
        "Offline DPO (train sft --loss-type dpo): JSONL key of a preference row's rejected image path.",
        jobs=DATASET_JOBS,
    ),
    _f(
        "data-source-path",
        DOTTED,
        None,
        "Data-source class; default: the built-in RolloutDataSourceWithBuffer.",
    ),
    _f(
        "disable-rollout-global-dataset",
        BOOL,
        False,
        "Do not load --prompt-data globally; your data source manages data itself.",
    ),
    _f("rollout-batch-size", INT, None, "Prompts per rollout; no default, every recipe sets it.", min=1),
    _f("n-samples-per-prompt", INT, 1, "Samples generated per prompt (the GRPO group size).", min=1),
    _f(
        "global-batch-size",
        INT,
        None,
        "Samples per optimizer step; must divide by the data-parallel size. Derived when unset.",
        min=1,
        meta={"default_text": "derived"},
    ),
    _f(
        "num-steps-per-rollout",
        INT,
        None,
        "Optimizer steps per rollout. Derived when unset.",
        min=1,
        meta={"default_text": "derived"},
    ),
    _f("micro-batch-size", INT, 1, "Train pairs per DiT forward (flat micro-batching).", min=1),
    _f(
        "micro-batch-size-sample",
        INT,
        None,
        "Samples per 2D micro-batch tile; set with --micro-batch-size-tstep, overrides --micro-batch-size.",
        min=1,
    ),
    _f(
        "micro-batch-size-tstep",
        INT,
        None,
        "SDE timesteps per 2D micro-batch tile; set with --micro-batch-size-sample.",
        min=1,
    ),
    _f(
        "diffusion-train-iter-order",
        ENUM,
        "sample_major",
        "Order in which 2D tiles are visited; only meaningful with the 2D micro-batch pair.",
        choices=("sample_major", "timestep_major"),
    ),
    _f(
        "train-dp-split-mode",
        ENUM,
        "contiguous",
        "How train pairs are dealt to data-parallel ranks: contiguous blocks or round-robin stride.",
        choices=("contiguous", "stride"),
    ),
    _f(
        "num-rollout",
        INT,
        None,
        "Total rollout iterations; default: derived from the dataset and --num-epoch.",
        min=1,
        meta={"default_text": "from dataset"},
    ),
    _f("num-epoch", INT, None, "Epochs over the dataset; ignored when --num-rollout is set.", min=1),
    _f(
        "start-rollout-id",
        INT,
        None,
        "First rollout id; resumed from --load when unset.",
        min=0,
    ),
    _f(
        "sft-encoder-checkpoint",
        PATH,
        None,
        "SFT only: where the tokenizer, text encoder and VAE are loaded from.",
        jobs=DATASET_JOBS,
    ),
    _f("sft-frame-stride", INT, 1, "SFT only: temporal stride when encoding video frames.", min=1, jobs=DATASET_JOBS),
]
