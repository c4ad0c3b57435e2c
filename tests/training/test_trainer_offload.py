"""--offload-train / --offload-rollout mechanics in-process: a trainer's FSDP2 parameters, gradients,
optimizer state and EMA, and an engine's pipeline, leave the device and come back bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from trainer_helpers import free_port, trainer_args

from miles.training.trainer import Trainer

pytestmark = pytest.mark.slow

# `rollout` (the in-process manager and its rollout 0) is a session fixture of tests/training/conftest.py.


def _local_bytes(tensor: torch.Tensor) -> int:
    local = getattr(tensor, "_local_tensor", tensor)
    return local.untyped_storage().nbytes()


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).clone()


def _snapshot(trainer: Trainer) -> dict[str, torch.Tensor]:
    out = {f"param/{k}": _full(v) for k, v in trainer.model.state_dict().items()}
    for i, state in enumerate(trainer.optimizer.state.values()):
        for k, v in state.items():
            if torch.is_tensor(v):
                out[f"optim/{i}/{k}"] = _full(v)
    if trainer.ema is not None:
        out.update({f"ema/{k}": v.clone() for k, v in trainer.ema.shadow.items()})
    return out


def test_trainer_round_trip_is_bit_exact_and_training_goes_on_identically(tiny_sd3_dir: Path, rollout) -> None:
    _, batch = rollout
    args = trainer_args(tiny_sd3_dir, lr=1e-3, use_ema=True, ema_rollout_policy="ema")
    plain, offloaded = (Trainer(args, master_port=free_port()) for _ in range(2))
    for trainer in (plain, offloaded):
        trainer.train(0, batch.samples)
    before = _snapshot(offloaded)

    partial = offloaded.offload(("optimizer", "grads"))
    optim_bytes = sum(v.numel() * v.element_size() for k, v in before.items() if k.startswith("optim/"))
    assert partial["bytes"] == optim_bytes > 0
    assert all(_local_bytes(p) > 0 for p in offloaded.model.parameters())  # parameters stay for the sync
    rest = offloaded.offload(("params",))
    assert all(_local_bytes(p) == 0 for p in offloaded.model.parameters())
    assert all(_local_bytes(t) == 0 for t in offloaded.ema.shadow.values())
    back = offloaded.onload()
    assert back["bytes"] == partial["bytes"] + rest["bytes"]
    after = _snapshot(offloaded)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)

    second = [trainer.train(1, batch.samples) for trainer in (plain, offloaded)]
    keys = [k for k in second[0] if k != "train_time"]
    assert {k: second[0][k] for k in keys} == {k: second[1][k] for k in keys}
    a, b = _snapshot(plain), _snapshot(offloaded)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_engine_round_trip_generates_the_same_samples(rollout) -> None:
    manager, batch = rollout
    engine = manager.engines[0]
    from miles.rollout.manager import build_requests

    groups = [[s for s in batch.samples if s.group_index == batch.samples[0].group_index]]
    request = build_requests(manager.args, groups, manager.strategy)[:1]
    first = engine.generate(request)
    moved = engine.offload()
    size = sum(p.numel() * p.element_size() for p in engine.pipe.transformer.parameters())
    assert moved["bytes"] >= size
    assert all(p.untyped_storage().nbytes() == 0 for p in engine.pipe.transformer.parameters())
    assert engine.onload()["bytes"] == moved["bytes"]
    again = engine.generate(request)
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a.trajectory.latents, b.trajectory.latents)
        assert torch.equal(a.trajectory.log_probs, b.trajectory.log_probs)
        assert torch.equal(a.image, b.image)


def test_engine_offload_releases_the_lora_merger_base_copies(rollout) -> None:
    """A LoRA-only sync leaves a base copy of each adapted weight on the engine's device; --offload-rollout releases
    it with the pipeline and the onload brings it back bit for bit (the next merge starts from it)."""
    manager, _ = rollout
    engine = manager.engines[0]
    name = next(n for n, _ in engine.transformer.named_parameters() if n.endswith("attn.to_q.weight"))
    prefix = name.removesuffix(".weight")
    weight = dict(engine.transformer.named_parameters())[name]
    out_f, in_f = weight.shape
    merger = engine.lora_merger
    saved = merger.base
    merger.base = {}
    try:
        merger.apply(engine.transformer, {
            f"{prefix}.lora_A": torch.zeros(2, in_f), f"{prefix}.lora_B": torch.zeros(out_f, 2),
            f"{prefix}.lora_scaling": torch.tensor(1.0, dtype=torch.float64),
        })  # fmt: skip
        base = merger.base[prefix]
        kept = base.clone()
        pipeline = sum(p.numel() * p.element_size() for p in engine.pipe.transformer.parameters())
        moved = engine.offload()
        assert moved["bytes"] >= pipeline + base.numel() * base.element_size()
        assert base.untyped_storage().nbytes() == 0
        assert engine.onload()["bytes"] == moved["bytes"]
        assert torch.equal(base, kept) and torch.equal(weight, kept)
    finally:
        merger.base = saved
