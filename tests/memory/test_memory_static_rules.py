"""The static estimate's rules on the shipped recipes' real sizes: torch-free and instant, and each flag moves the
bytes the trainer and engine code move (offload between phases, --fsdp-cpu-offload, HSDP, EMA, DMD2's teacher, the
weight-sync bucket, the frozen base off the device before a LoRA-only sync, the diffusers engine's LoRA base copies
in host memory)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from miles.config.resolve import resolve
from miles.memory.static import LORA_BASE_COPIES, TRAIN, denoiser_of, shard_group_size, static_memory

ROOT = Path(__file__).resolve().parents[2]
MASTER_FP32 = 4


def _on(memory, label: str, phase: str) -> dict[str, int]:
    gpu = next(g for g in memory.gpus if label in g.slots)
    return {e.name: e.bytes for e in gpu.phases.get(phase, []) if e.owner == label}


def test_the_estimate_imports_no_torch_and_is_instant(tmp_path: Path) -> None:
    """With the shipped counts current (test_memory_real_configs checks they are), no recipe measures anything."""
    code = (
        "import sys, time\n"
        "from miles.config.resolve import resolve\n"
        "from miles.memory.shipped import shipped_recipes\n"
        "from miles.memory.static import static_memory\n"
        "names = [name for name, _, _ in shipped_recipes()]\n"
        "start = time.perf_counter()\n"
        "for name in names:\n"
        "    static_memory(resolve(None, recipe=name))\n"
        "print('SECONDS', time.perf_counter() - start)\n"
        "print('HEAVY', [m for m in ('torch', 'diffusers', 'transformers', 'ray') if m in sys.modules])\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MILES_HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert lines["HEAVY"] == "[]"
    assert float(lines["SECONDS"]) < 5.0  # nine recipes (about 0.3 s here)


def _adapter_shard_bytes(resolved) -> int:
    from miles.memory.cache import model_counts
    from miles.memory.config_dirs import config_dir_for
    from miles.memory.static import lora_targets
    from miles.models.families import args_family
    from miles.models.pipeline_config import target_components

    args = resolved.args
    family = args_family(args)
    components = family.denoiser_components(target_components(args.update_weight_target_module))
    counts = model_counts(
        config_dir_for(str(args.hf_checkpoint), family), family, components, [lora_targets(args, family)]
    )
    denoiser, _ = denoiser_of(counts, family, args)
    return denoiser.sharded_bytes(shard_group_size(args), "adapters")


def test_colocated_phases_follow_the_offload_switches() -> None:
    memory = static_memory(resolve(None, recipe="sd3-ocr-grpo"))
    train, sync, rollout = (_on(memory, "actor 0", p) for p in ("train", "sync", "rollout"))
    assert {"params", "buffers", "grads", "adam"} <= set(train)
    assert "params" in sync and "grads" not in sync and "adam" not in sync  # dropped after train
    assert not rollout  # parameters too after the sync
    engine = {p: _on(memory, "engine 0", p) for p in ("train", "sync", "rollout")}
    assert "pipeline" not in engine["train"] and "pipeline" in engine["sync"] and "pipeline" in engine["rollout"]
    # the diffusers engine's LoRA-only merge keeps its base copies in host memory: no GPU bytes, a note with the size;
    # on the GPU only one module's base and its fp32 merge, in the sync
    assert not any(name == LORA_BASE_COPIES for phase in engine.values() for name in phase)
    (note,) = [n for n in memory.notes if n.startswith(LORA_BASE_COPIES)]
    assert "GiB per engine" in note and "host memory" in note
    assert "lora_merger/merge" not in engine["train"] and "lora_merger/merge" not in engine["rollout"]
    assert 0 < engine["sync"]["lora_merger/merge"] < engine["sync"]["pipeline"] // 20
    gpu, phase, peak = memory.peak()
    assert phase == "sync" and peak == gpu.total("sync")  # the trainer's adapters and the woken engine together


def test_a_lora_only_sync_holds_only_the_adapters_a_full_sync_the_whole_model() -> None:
    """Before a LoRA-only sync `--offload-train` drops the frozen base, the buffers and the frozen reference
    (`Trainer.offload`'s "frozen"): the sync phase counts the adapters' shards only; a full sync reads the whole
    model, which stays as before."""
    frozen = {"ref_mode": "frozen"}
    resolved = resolve(None, recipe="sd3-ocr-grpo", cli=frozen)
    lora_only = static_memory(resolved)
    full = static_memory(resolve(None, recipe="sd3-ocr-grpo", cli=frozen | {"lora_ipc_weight_sync": False}))
    adapters = _adapter_shard_bytes(resolved)
    train, sync = _on(lora_only, "actor 0", "train"), _on(lora_only, "actor 0", "sync")
    assert train["params"] > sync["params"] == adapters > 0
    assert train["buffers"] > 0 and train["ref/frozen"] == train["params"]
    assert not {"buffers", "ref/frozen", "ref/frozen_buffers"} & set(sync)
    assert sync["sync/bucket"] > 0  # what the sync itself needs stays
    full_train, full_sync = _on(full, "actor 0", "train"), _on(full, "actor 0", "sync")
    for name in ("params", "buffers", "ref/frozen", "ref/frozen_buffers"):
        assert full_sync[name] == full_train[name] == train[name] > 0  # the same model, kept through a full sync
    assert not any(n.startswith(LORA_BASE_COPIES) for n in full.notes)  # a full update drops the base copies


def test_the_ema_stays_for_the_sync_only_when_it_is_served() -> None:
    served = _on(static_memory(resolve(None, recipe="sd3-pickscore-nft")), "actor 0", "sync")
    live = static_memory(resolve(None, recipe="sd3-pickscore-nft", cli={"ema_rollout_policy": "live"}))
    assert served["ema"] > 0 and served["ema/swap_backup"] > 0  # --ema-rollout-policy ema swaps it in
    assert "ema" not in _on(live, "actor 0", "sync") and "ema" in _on(live, "actor 0", "train")


def test_without_colocation_each_gpu_keeps_its_state() -> None:
    cli = {"colocate": False, "num_gpus_per_node": 4, "rollout_num_gpus": 2, "lora_ipc_weight_sync": False}
    memory = static_memory(resolve(None, recipe="sd3-ocr-grpo", cli=cli))
    for phase in ("train", "sync", "rollout"):
        assert {"params", "grads", "adam"} <= set(_on(memory, "actor 0", phase))
        engine = _on(memory, "engine 0", phase)
        assert "pipeline" in engine and "lora_merger/base_copies" not in engine
    assert "sync/bucket" not in _on(memory, "actor 0", "sync")  # weights go through Ray, not by handle
    trainer_gpu = next(g for g in memory.gpus if "actor 0" in g.slots)
    assert not any(s.startswith("engine") for s in trainer_gpu.slots)


def test_fsdp_cpu_offload_moves_the_sharded_state_to_the_host() -> None:
    plain = _on(static_memory(resolve(None, recipe="sd35-4step")), "critic 0", TRAIN)
    offload = _on(static_memory(resolve(None, recipe="sd35-4step", cli={"fsdp_cpu_offload": True})), "critic 0", TRAIN)
    assert plain["params"] > 0 and offload["params"] == offload["grads"] == offload["adam"] == 0
    assert offload["buffers"] == plain["buffers"] > 0  # FSDP2 offloads parameters, not buffers
    assert offload["teacher"] == plain["buffers"]  # the teacher's shards on the host too, its buffers not


def test_hsdp_shards_over_the_replica() -> None:
    one = _on(static_memory(resolve(None, recipe="sd35-4step")), "critic 0", TRAIN)
    two = _on(static_memory(resolve(None, recipe="sd35-4step", cli={"dp_replicate_size": 2})), "critic 0", TRAIN)
    assert one["params"] == 2_243_171_520 * MASTER_FP32 // 8  # every dim of SD3.5's MMDiT divides by 8
    assert two["params"] == 2 * one["params"] and two["adam"] == 2 * one["adam"]


def test_adam_ema_and_swap_backups() -> None:
    memory = static_memory(resolve(None, recipe="sd3-pickscore-nft"))
    train, sync = _on(memory, "actor 0", "train"), _on(memory, "actor 0", "sync")
    trainable = 18_776_064 // 2  # rank 0's half of the adapters (2 ranks)
    assert train["grads"] == trainable * MASTER_FP32 and train["adam"] == 2 * trainable * MASTER_FP32
    assert train["ema"] == trainable * 4 and sync["ema"] == train["ema"]
    assert train["ema/swap_backup"] == sync["ema/swap_backup"] == trainable * MASTER_FP32  # ref ema; rollout ema


def test_dmd2_keeps_the_frozen_teacher_in_every_phase() -> None:
    memory = static_memory(resolve(None, recipe="sd35-4step"))
    critic = {p: _on(memory, "critic 0", p) for p in ("train", "sync", "rollout")}
    assert critic["train"]["teacher"] == critic["rollout"]["teacher"] > 0
    assert "sync/gather" not in critic["sync"]  # only the student syncs to the engines
    assert "teacher" not in _on(memory, "actor 0", "train")


def test_the_weight_sync_bucket() -> None:
    memory = static_memory(resolve(None, recipe="sd3-ocr-grpo"))
    sync = _on(memory, "actor 0", "sync")
    assert sync["sync/bucket"] == 18_776_064 * MASTER_FP32  # the fp32 LoRA tensors fit one 2 GiB bucket
    small = static_memory(resolve(None, recipe="sd3-ocr-grpo", cli={"update_weight_buffer_size": 1 << 20}))
    gpu = next(g for g in small.gpus if "actor 0" in g.slots)
    bucket = next(e for e in gpu.phases["sync"] if e.name == "sync/bucket")
    assert bucket.bytes == 1 << 20 and bucket.note.startswith("bound")
    assert _on(memory, "actor 1", "sync")["sync/bucket"] == sync["sync/bucket"]  # each rank feeds its own engine


def test_sglang_engines_keep_no_counted_base_copies() -> None:
    memory = static_memory(resolve(None, recipe="sd3-ocr-grpo", cli={"rollout_backend": "sglang"}))
    assert "lora_merger/base_copies" not in _on(memory, "engine 0", "rollout")
    assert any("sglang" in note for note in memory.notes)


def test_the_frozen_reference_is_a_second_copy_of_the_params() -> None:
    """--ref-mode frozen (dpo's automatic reference without LoRA) holds a frozen copy of the start weights, sharded
    like the params and moved with them by --offload-train; under LoRA dpo's reference is the model's own base."""
    full = {"loss_type": "dpo", "use_lora": False, "lora_ipc_weight_sync": False, "use_ema": False}
    full |= {
        "ema_rollout_policy": "live",
        "globalize_reward_std": False,
        "ref_mode": "frozen",
        "diffusion_kl_beta": 0.0,
    }
    memory = static_memory(resolve(None, recipe="sd3-pickscore-nft", cli=full))
    train = _on(memory, "actor 0", "train")
    assert train["ref/frozen"] == train["params"] > 0 and train["ref/frozen_buffers"] == train["buffers"]
    assert "ref/frozen" not in _on(memory, "actor 0", "rollout")  # offloaded with the params (colocated)
    lora = full | {"use_lora": True, "lora_ipc_weight_sync": True, "ref_mode": "lora_base"}
    assert not any(
        name.startswith("ref/")
        for name in _on(static_memory(resolve(None, recipe="sd3-pickscore-nft", cli=lora)), "actor 0", "train")
    )


def test_dpos_traced_micro_batch_holds_winners_and_losers() -> None:
    """The method table's `forward_rows`: a dpo pair is two rows of the trained forward, never CFG's (nft: one)."""
    from miles.memory.config_dirs import config_dir_for
    from miles.memory.step import read_configs, train_spec
    from miles.models.families import resolve_family
    from miles.models.pipeline_config import target_components

    specs = {}
    for loss in ("dpo", "nft"):
        cli = {"loss_type": loss, "micro_batch_size": 3}
        if loss == "dpo":
            cli |= {
                "use_ema": False,
                "ema_rollout_policy": "live",
                "globalize_reward_std": False,
                "ref_mode": "lora_base",
                "diffusion_kl_beta": 0.0,  # the recipe's NFT KL; dpo's reference is in its loss
            }
        args = resolve(None, recipe="sd3-pickscore-nft", cli=cli).args
        family = resolve_family(args.hf_checkpoint, family=args.diffusion_model_family)
        configs = read_configs(config_dir_for(args.hf_checkpoint, family))
        specs[loss] = train_spec(args, family, configs, family.denoiser_components(target_components(args)))
    assert specs["dpo"].batch == 2 * specs["nft"].batch == 6
    assert not specs["dpo"].cfg
