"""Training backend: FSDP2 sharding, precision, sequence parallelism."""

from __future__ import annotations

from miles.config.catalog._common import flag_maker
from miles.config.flags import BOOL, ENUM, FLOAT, INT, JSON, STR, Flag

GROUP = "Training backend"
_f = flag_maker(GROUP)

DTYPES = ("fp32", "bf16", "fp16")

FLAGS: list[Flag] = [
    _f("train-backend", ENUM, "fsdp", "Training backend; FSDP2 is the only one.", choices=("fsdp",)),
    _f(
        "fsdp-master-dtype",
        ENUM,
        "fp32",
        "Precision of the loaded and sharded master weights and of the optimizer state.",
        choices=DTYPES,
    ),
    _f(
        "fsdp-reduce-dtype",
        ENUM,
        "fp32",
        "Precision of the gradient reduce-scatter; bf16 mimics flow_grpo but adds cross-rank rounding noise.",
        choices=DTYPES,
    ),
    _f(
        "diffusion-forward-dtype",
        ENUM,
        "bf16",
        "Compute dtype of the DiT forward on the engine, as the FSDP param dtype and for training inputs.",
        choices=DTYPES,
    ),
    _f(
        "fsdp-cpu-offload",
        BOOL,
        False,
        "Keep parameters, gradients and optimizer state on the CPU; the optimizer step then runs on the CPU.",
    ),
    _f(
        "fsdp-cpu-backend",
        STR,
        "gloo",
        "Process-group backend for CPU tensors: the cpu: half of the hybrid group under --fsdp-cpu-offload on "
        "GPUs, and the whole process group of a CPU-only trainer rank.",
    ),
    _f(
        "dp-replicate-size",
        INT,
        1,
        "HSDP replica count; the shard dimension takes the ranks left after this and sequence parallelism.",
        min=1,
    ),
    _f("sequence-parallel-size", INT, 1, "Training-side USP degree (Ulysses x Ring).", min=1),
    _f(
        "ulysses-degree",
        INT,
        0,
        "Ulysses part of the sequence-parallel degree; 0 = auto (Ulysses fills it). A ring degree "
        "(sequence-parallel size / Ulysses degree) > 1 needs ring attention, which miles' trainer refuses.",
        min=0,
    ),
    _f(
        "fsdp-attention-backend",
        STR,
        None,
        "Attention backend of the trained DiT, a diffusers set_attention_backend name (native, _native_math, "
        "flash, ...); CUDA-only ones are refused on a CPU rank.",
    ),
    _f(
        "fsdp-flow-shift",
        FLOAT,
        None,
        "Shift of the training-side sigma grid, used when no engine supplies scheduler metadata (SFT); "
        "distinct from --diffusion-flow-shift.",
        min=0,
    ),
    _f("gradient-checkpointing", BOOL, False, "Recompute activations in backward to save memory."),
    _f("deterministic-mode", BOOL, False, "Make the training forward and backward bitwise repeatable."),
    _f(
        "train-env-vars",
        JSON,
        {},
        "Extra environment variables for the training processes, as a JSON object.",
        # The default dict is shared by the (frozen) Flag: callers must deep-copy it before mutating.
        meta={"default_text": "{}"},
    ),
]
