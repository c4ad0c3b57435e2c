"""The worker of tests/training/test_parallel.py: one gloo rank that trains one Flow-GRPO step per layout.

Four ranks are spawned once; inside, every layout of `LAYOUTS` builds a `Trainer` on the same 4-rank
process group, takes one optimizer step on the same rollout and records (on rank 0) the metrics, the
full (gathered) gradients the optimizer is about to apply, and the full weights after the step.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from trainer_helpers import trainer_args

WORLD = 4
TIMEOUT_MINUTES = 7
LORA: dict[str, Any] = {
    "use_lora": True,
    "lora_rank": 4,
    "lora_alpha": 8,
    "lora_init_weights": "gaussian",
    "diffusion_kl_beta": 0.1,  # adds the reference forward (adapter off)
}
# name -> (flags, the layout it must equal)
LAYOUTS: dict[str, tuple[dict[str, Any], str]] = {
    "fsdp4": ({}, "fsdp4"),
    "hsdp2x2": ({"dp_replicate_size": 2}, "fsdp4"),
    "sp2": ({"sequence_parallel_size": 2}, "fsdp4"),
    "sp4": ({"sequence_parallel_size": 4}, "fsdp4"),
    "sp2_hsdp2": ({"sequence_parallel_size": 2, "dp_replicate_size": 2}, "fsdp4"),
    "sp2_native_math": ({"sequence_parallel_size": 2, "fsdp_attention_backend": "_native_math"}, "fsdp4"),
    "sp2_checkpointing": ({"sequence_parallel_size": 2, "gradient_checkpointing": True}, "fsdp4"),
    "cpu_offload": ({"fsdp_cpu_offload": True}, "fsdp4"),
    "lora_fsdp4": (LORA, "lora_fsdp4"),
    "lora_sp2_hsdp2": ({**LORA, "sequence_parallel_size": 2, "dp_replicate_size": 2}, "lora_fsdp4"),
}


def off_policy(samples: list[Any]) -> list[Any]:
    """Copies of `samples` whose recorded log-probs are moved by up to 0.008 (inside the recipe's clip range
    1e-2): the ratios leave 1, so the Flow-GRPO loss and every pair's gradient are far from zero."""
    import copy

    out = copy.deepcopy(samples)
    for i, sample in enumerate(out):
        log_probs = sample.trajectory.log_probs
        shift = 0.008 * torch.sin(torch.arange(log_probs.numel(), dtype=torch.float64) + 3.0 * i)
        sample.trajectory.log_probs = log_probs + shift.to(log_probs.dtype).reshape(log_probs.shape)
    return out


def layout_args(checkpoint: Path, flags: dict[str, Any]) -> Any:
    return trainer_args(
        checkpoint,
        actor_num_gpus_per_node=WORLD,
        num_gpus_per_node=WORLD,
        distributed_timeout_minutes=TIMEOUT_MINUTES,
        lr=1e-4,
        **flags,
    )


def one_step(trainer: Any, samples: list[Any]) -> dict[str, Any]:
    """Train one step; returns the metrics, the full gradients at the optimizer step and the full weights after."""
    from miles.training.model import full_state_dict

    grads: dict[str, torch.Tensor] = {}

    def capture(optimizer: Any, args: Any, kwargs: Any) -> None:
        for name, param in trainer.model.named_parameters():
            if param.grad is not None:  # full_tensor() is a collective: every rank runs it, in the same order
                grad = param.grad
                grads[name] = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().clone()

    handle = trainer.optimizer.register_step_pre_hook(capture)
    metrics = trainer.train(0, samples)
    handle.remove()
    return {"metrics": metrics, "grads": grads, "weights": full_state_dict(trainer.model)}


def group_timeouts(trainer: Any) -> dict[str, float]:
    """The timeout, in seconds, of every process group the trainer made (world, SP group, HSDP mesh dims)."""
    import torch.distributed as dist

    def seconds(group: Any) -> float:
        return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()

    out = {"world": seconds(dist.group.WORLD)}
    if trainer.layout.sp_group is not None:
        out["sp"] = seconds(trainer.layout.sp_group)
    if trainer.layout.mesh is not None:
        for dim in trainer.layout.mesh.mesh_dim_names:
            out[dim] = seconds(trainer.layout.mesh.get_group(dim))
    return out


def worker(rank: int, port: int, checkpoint: Path, samples: list[Any], out: Path) -> None:
    from miles.training.trainer import Trainer

    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    for name, (flags, _) in LAYOUTS.items():
        start = time.perf_counter()
        trainer = Trainer(layout_args(checkpoint, flags), rank, WORLD, master_port=port)
        result = one_step(trainer, samples)
        result["dp"] = (trainer.dp_rank, trainer.dp_size)
        result["timeouts"] = group_timeouts(trainer)
        result["seconds"] = time.perf_counter() - start
        results[name] = result
    torch.save(results, out / f"rank{rank}.pt")
