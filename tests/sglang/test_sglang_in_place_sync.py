"""In-place weight sync to a real sglang-diffusion server on CPU (--colocate): the trainer passes
`/update_weights_from_tensor` shared-memory handles, the server maps the trainer's buckets, and every
transformer parameter is then checked against the trainer's digests (`/update_weights_from_tensor_checker`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from miles.config.resolve import resolve

SMALL: dict[str, Any] = {
    "rollout_backend": "sglang",
    "colocate": True,
    "rollout_batch_size": 2,
    "n_samples_per_prompt": 4,
    "rollout_microgroup_size": 4,
    "global_batch_size": 8,
    "micro_batch_size": 4,
    "diffusion_num_steps": 4,
    "diffusion_num_sde_steps": 2,
    "diffusion_sde_window_range": "0,4",
    "lr_warmup_iters": 0,
    "lr": 1e-2,
}


def _run(args: Any, rollouts: int = 2) -> list[dict[str, float]]:
    import ray

    from miles.rollout.manager import manager_actor_class
    from miles.runtime.train_rl import run_iteration
    from miles.runtime.trainer_group import TrainerGroup

    manager = manager_actor_class().options(num_cpus=0).remote(args, None, True)
    group = None
    try:
        group = TrainerGroup(args, "actor", total_steps=2 * rollouts)
        return [run_iteration(args, manager, group, rollout_id)[0] for rollout_id in range(rollouts)]
    finally:
        if group is not None:
            group.shutdown()
        ray.get(manager.shutdown.remote())
        ray.kill(manager)


def _check(metrics: list[dict[str, float]], out: Path, tensors: int) -> None:
    for m in metrics:
        assert m["sync/verified_tensors"] == 66.0  # every transformer parameter, bit for bit
        assert m["sync/engines_agree"] == 1.0 and m["sync/engines"] == 1.0
        assert m["sync/tensors"] == tensors
        assert m["sync/bytes_serialized"] < 16 * 1024 < m["sync/bytes_by_handle"]
    assert not (out / "engines" / "weights").exists()  # nothing written for /update_weights_from_disk or set_lora


@pytest.mark.extended  # the LoRA test below and tests/sglang/test_sglang_cli.py take the same in-place path
def test_full_weights_go_to_the_server_by_handle(tiny_sd3_dir: Path, tmp_path: Path, local_ray) -> None:
    args = resolve(
        "rl", recipe="tiny-digits-grpo", cli={**SMALL, "hf_checkpoint": str(tiny_sd3_dir), "output_dir": str(tmp_path)}
    ).args
    _check(_run(args), tmp_path, tensors=67)  # 66 parameters and the positional-embedding buffer


def test_lora_goes_to_the_server_by_handle_as_lora_merge(tiny_sd3_dir: Path, tmp_path: Path, local_ray) -> None:
    cli = {**SMALL, "hf_checkpoint": str(tiny_sd3_dir), "output_dir": str(tmp_path), "use_lora": True}
    cli.update(lora_rank=4, lora_alpha=8, lora_init_weights="gaussian")
    args = resolve("rl", recipe="tiny-digits-grpo", cli=cli).args
    _check(_run(args), tmp_path, tensors=30)  # lora_A and lora_B of 15 modules; the merge checked on all 66
