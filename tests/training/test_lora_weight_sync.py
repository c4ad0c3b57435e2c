"""`--lora-ipc-weight-sync`: after LoRA train steps the engine, sent only the adapter, serves the trainer's
merged weights exactly (mirrors the full-sync test in test_trainer.py on the same shared engine)."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import pytest
import torch
from trainer_helpers import free_port, trainer_args

from miles.training.trainer import Trainer

pytestmark = pytest.mark.slow

LORA = {"use_lora": True, "lora_rank": 4, "lora_alpha": 8, "lr": 1e-2, "lora_init_weights": "gaussian"}


def _nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _median_seconds(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def test_lora_only_sync_sends_the_adapter_and_the_engine_serves_the_merged_weights(
    tiny_sd3_dir: Path, rollout
) -> None:
    manager, batch = rollout
    args = trainer_args(tiny_sd3_dir, **LORA, lora_ipc_weight_sync=True, colocate=True)
    trainer = Trainer(args, master_port=free_port())
    base = trainer.engine_weights()
    try:
        for version in (1, 2):  # the second merge must replace the first, not add to it
            trainer.train(version - 1, batch.samples)
            payload = trainer.weights_for_sync()
            assert payload and all("lora_" in name for name in payload)
            assert manager.update_weights(payload, version) == len(payload)
            merged = trainer.engine_weights()
            assert _max_diff(manager.engine_state_dict(), merged) == 0.0
            assert _max_diff(merged, base) > 0.0
        full_bytes, lora_bytes = _nbytes(merged), _nbytes(payload)
        assert lora_bytes < full_bytes / 4

        def lora_sync() -> None:
            manager.update_weights(trainer.weights_for_sync(), 3)

        def full_sync() -> None:
            manager.update_weights(trainer.engine_weights(), 3)

        lora_s = _median_seconds(lora_sync)  # first: a full sync makes the pushed weights the new base
        full_s = _median_seconds(full_sync)
        print(
            f"\nweight sync of tiny-sd3 with LoRA r=4 ({len(payload)} tensors): LoRA-only {lora_bytes / 1024:.1f} KiB "
            f"in {1e3 * lora_s:.2f} ms; full {full_bytes / 1024:.1f} KiB in {1e3 * full_s:.2f} ms "
            f"({full_bytes / lora_bytes:.1f}x the bytes)"
        )
    finally:
        manager.update_weights(base, 4)  # put the shared engine back (a full update resets its LoRA base copies)
    assert _max_diff(manager.engine_state_dict(), base) == 0.0
