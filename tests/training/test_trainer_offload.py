"""--offload-train / --offload-rollout mechanics in-process: a trainer's FSDP2 parameters, gradients,
optimizer state and EMA, and an engine's pipeline, leave the device and come back bit for bit; before a LoRA-only
sync the trainer's frozen base leaves too, and the sync reads the same adapters."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from trainer_helpers import free_port, trainer_args

from miles.runtime.phases import BEFORE_SYNC
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


LORA = {"use_lora": True, "lora_rank": 4, "lora_alpha": 8, "lr": 1e-2, "lora_init_weights": "gaussian"}


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (their FSDP2 local shards)."""
    seen = {}
    for t in tensors:
        storage = getattr(t, "_local_tensor", t).untyped_storage()
        seen[storage._cdata] = storage.nbytes()
    return sum(seen.values())


def _optimizer_bytes(trainer: Trainer) -> int:
    return _storage_bytes(v for st in trainer.optimizer.state.values() for v in st.values() if torch.is_tensor(v))


@pytest.mark.parametrize(("ref_mode", "policy"), [("frozen", "ema"), ("ema", "live")])
def test_before_a_lora_only_sync_the_frozen_base_leaves_and_the_sync_reads_the_same_adapters(
    tiny_sd3_dir: Path, rollout, ref_mode: str, policy: str
) -> None:
    """`Phases.to_sync`'s offload of a LoRA-only-sync trainer: optimizer state, gradients and everything the sync does
    not read (frozen base, buffers, frozen reference; the EMA shadow unless --ema-rollout-policy ema serves it) leave
    the device, the adapters stay and `weights_for_sync()` gives the same payload bit for bit; `to_rollout` takes
    the rest and the onload brings every byte back."""
    _, batch = rollout
    sync = {"lora_ipc_weight_sync": True, "colocate": True, "use_ema": True, "ema_rollout_policy": policy}
    trainer = Trainer(trainer_args(tiny_sd3_dir, **LORA, **sync, ref_mode=ref_mode), master_port=free_port())
    trainer.train(0, batch.samples)
    before = _snapshot(trainer)
    payload = trainer.weights_for_sync()
    assert payload and all("lora_" in name for name in payload)
    adapters = [p for p in trainer.model.parameters() if p.requires_grad]
    base = [p for p in trainer.model.parameters() if not p.requires_grad]
    buffers = list(trainer.model.buffers())
    frozen = trainer.frozen_reference
    reference = [*frozen.parameters(), *frozen.buffers()] if frozen is not None else []
    assert (ref_mode == "frozen") == bool(reference)
    shadow = list(trainer.ema.shadow.values())
    assert adapters and base and shadow
    reference_before = [_full(t) for t in reference]
    leaving = base + buffers + reference + (shadow if policy == "live" else [])
    expected = _optimizer_bytes(trainer) + _storage_bytes(leaving)

    moved = trainer.offload(BEFORE_SYNC)
    assert moved["bytes"] == expected
    assert all(_local_bytes(t) == 0 for t in leaving)
    assert all(_local_bytes(p) > 0 for p in adapters)  # what the sync reads stays
    assert all((_local_bytes(t) > 0) == (policy == "ema") for t in shadow)
    again = trainer.weights_for_sync()
    assert again.keys() == payload.keys() and all(torch.equal(again[k], payload[k]) for k in payload)

    rest = trainer.offload(("params",))  # to_rollout: the storages already off stay off, the rest follows
    assert all(_local_bytes(t) == 0 for t in adapters + shadow)
    assert trainer.onload()["bytes"] == moved["bytes"] + rest["bytes"]
    after = _snapshot(trainer)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert all(torch.equal(a, _full(b)) for a, b in zip(reference_before, reference, strict=True))


def test_a_full_sync_trainer_keeps_its_whole_model_through_to_sync(tiny_sd3_dir: Path, rollout) -> None:
    """A LoRA trainer whose sync pushes the merged model (no --lora-ipc-weight-sync) reads every parameter in the
    sync: `to_sync` moves only optimizer state and gradients, as before (the frozen reference and EMA stay too)."""
    _, batch = rollout
    args = trainer_args(tiny_sd3_dir, **LORA, use_ema=True, ema_rollout_policy="ema", ref_mode="frozen")
    trainer = Trainer(args, master_port=free_port())
    trainer.train(0, batch.samples)
    optimizer = _optimizer_bytes(trainer)
    before = _snapshot(trainer)
    moved = trainer.offload(BEFORE_SYNC)
    assert moved["bytes"] == optimizer > 0
    kept = [*trainer.model.parameters(), *trainer.model.buffers(), *trainer.frozen_reference.parameters()]
    assert all(_local_bytes(t) > 0 for t in kept)
    assert all(_local_bytes(t) > 0 for t in trainer.ema.shadow.values())
    state = trainer.weights_for_sync()
    assert not any("lora_" in name for name in state)  # the merged model
    assert trainer.onload()["bytes"] == moved["bytes"]
    after = _snapshot(trainer)
    assert all(torch.equal(before[k], after[k]) for k in before)


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
    """A LoRA-only sync leaves a base copy of each adapted weight in host memory, which on this CPU engine is its
    device: --offload-rollout releases it with the pipeline and the onload brings it back bit for bit (the next merge
    starts from it). Next to GPU weights the copies are pinned host memory already, and the offload leaves them."""
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
