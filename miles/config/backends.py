"""Names the backend flags accept (torch-free): the training backends and the device each one needs, and the
built-in rollout functions (`--rollout-function-path`; the rollout hooks and their config rules read them here, so
the rules import no rollout code).

`--distributed-backend` / `--fsdp-cpu-backend` take torch.distributed backend names
(`torch.distributed.Backend.backend_list`); `--fsdp-attention-backend` takes diffusers' attention
backend names (`diffusers.models.attention_dispatch.AttentionBackendName`). Both lists are kept here
so the config can check them before torch is imported; tests/training/test_parallel_units.py checks them
against the installed torch and diffusers.
"""

from __future__ import annotations

# torch.distributed backend -> the device types whose tensors it can move.
DISTRIBUTED_BACKENDS: dict[str, tuple[str, ...]] = {
    "gloo": ("cpu", "cuda"),
    "nccl": ("cuda",),
    "ucc": ("cpu", "cuda"),
    "mpi": ("cpu", "cuda"),
    "xccl": ("xpu",),
}

_CUDA, _ANY = "cuda", None

# diffusers attention backend -> the device the trainer (forward and backward) needs for it (None: any device,
# the CPU included).
ATTENTION_BACKENDS: dict[str, str | None] = {
    "flash": _CUDA,
    "flash_hub": _CUDA,
    "flash_varlen": _CUDA,
    "flash_varlen_hub": _CUDA,
    "flash_4_hub": _CUDA,
    "_flash_3": _CUDA,
    "_flash_varlen_3": _CUDA,
    "_flash_3_hub": _CUDA,
    "_flash_3_varlen_hub": _CUDA,
    "aiter_fa2_hub": _CUDA,
    "flex": _CUDA,  # torch's FlexAttention has no backward on the CPU (torch 2.13), and the trainer needs one
    "native": _ANY,
    "_native_cudnn": _CUDA,
    "_native_efficient": _CUDA,
    "_native_flash": _CUDA,
    "_native_math": _ANY,
    "_native_npu": "npu",
    "_native_xla": "xla",
    "sage": _CUDA,
    "sage_hub": _CUDA,
    "sage_blackwell_hub": _CUDA,
    "sage_varlen": _CUDA,
    "_sage_qk_int8_pv_fp8_cuda": _CUDA,
    "_sage_qk_int8_pv_fp8_cuda_sm90": _CUDA,
    "_sage_qk_int8_pv_fp16_cuda": _CUDA,
    "_sage_qk_int8_pv_fp16_triton": _CUDA,
    "xformers": _CUDA,
}

# What a device-type name reads as in messages.
DEVICE_WORDS = {"cuda": "CUDA", "xpu": "an XPU", "npu": "an NPU", "xla": "an XLA device", "cpu": "the CPU"}


def cpu_capable(backend: str) -> bool:
    """A process-group backend that can hold CPU tensors (gloo, mpi, ucc)."""
    return "cpu" in DISTRIBUTED_BACKENDS.get(backend, ())


def attention_backends_on_cpu() -> list[str]:
    return [name for name, device in ATTENTION_BACKENDS.items() if device is None]


# The rollout functions miles ships (`--rollout-function-path` naming one of them is the built-in rollout).
BUILTIN_ROLLOUTS = frozenset(
    {
        "miles.rollout.sglang_rollout.generate_rollout",
        "miles.rollout.sglang_diffusion_rollout.generate_rollout",
        "miles.rollout.manager.RolloutManager.generate",
    }
)


def is_builtin_rollout(path: str | None) -> bool:
    return not path or str(path).strip() in BUILTIN_ROLLOUTS
