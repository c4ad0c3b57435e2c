"""The static estimate's rules on the shipped recipes' real sizes: torch-free and instant, and each flag moves the
bytes the trainer and engine code move (offload between phases, --fsdp-cpu-offload, HSDP, EMA, DMD2's teacher, the
weight-sync bucket, the diffusers engine's LoRA base copies)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from miles.config.resolve import resolve
from miles.memory.static import TRAIN, static_memory

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


def test_colocated_phases_follow_the_offload_switches() -> None:
    memory = static_memory(resolve(None, recipe="sd3-ocr-grpo"))
    train, sync, rollout = (_on(memory, "actor 0", p) for p in ("train", "sync", "rollout"))
    assert {"params", "buffers", "grads", "adam"} <= set(train)
    assert "params" in sync and "grads" not in sync and "adam" not in sync  # dropped after train
    assert not rollout  # parameters too after the sync
    engine = {p: _on(memory, "engine 0", p) for p in ("train", "sync", "rollout")}
    assert "pipeline" not in engine["train"] and "pipeline" in engine["sync"] and "pipeline" in engine["rollout"]
    # the diffusers engine's LoRA-only merge keeps base copies, released with the pipeline while the trainer trains
    assert "lora_merger/base_copies" not in engine["train"]
    assert engine["sync"]["lora_merger/base_copies"] == engine["rollout"]["lora_merger/base_copies"] > 0
    gpu, phase, peak = memory.peak()
    assert phase == "sync" and peak == gpu.total("sync")  # trainer parameters and the woken engine together


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
    full |= {"ema_rollout_policy": "live", "globalize_reward_std": False, "ref_mode": "frozen"}
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
            }
        args = resolve(None, recipe="sd3-pickscore-nft", cli=cli).args
        family = resolve_family(args.hf_checkpoint, family=args.diffusion_model_family)
        configs = read_configs(config_dir_for(args.hf_checkpoint, family))
        specs[loss] = train_spec(args, family, configs, family.denoiser_components(target_components(args)))
    assert specs["dpo"].batch == 2 * specs["nft"].batch == 6
    assert not specs["dpo"].cfg
