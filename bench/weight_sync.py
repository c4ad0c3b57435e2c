"""Weight sync through Ray's object store: the full LoRA-merged transformer against only the LoRA tensors
(`--lora-ipc-weight-sync`), both as `miles train rl` runs them on CPU.

One trainer rank (a Ray actor) trains tiny-sd3 with a LoRA adapter for one step; two rollout managers
(Ray actors, each with its own engine actor) receive its weights: one the full merged state, one only
lora_A/lora_B/scaling, which its engine merges into its base weights. The bench first checks that both
engines then serve exactly the trainer's merged weights, then times one sync each way (gather on the
trainer, object store to the driver and on to the manager and its engine, load or merge): the
`perf/sync_time` of `train rl`. Prints bytes and medians of interleaved runs.

    python bench/weight_sync.py [--lora-rank 4] [--repeats 7]
"""

from __future__ import annotations

import argparse
import sys

from bench_timing import interleaved_medians


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lora-rank", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=7)
    opts = parser.parse_args()

    import ray

    from miles.config.resolve import resolve
    from miles.models.checkpoints import ensure_checkpoint
    from miles.rollout.manager import manager_actor_class
    from miles.runtime.ray_setup import init_ray
    from miles.runtime.trainer_group import TrainerGroup

    cli = {
        "hf_checkpoint": str(ensure_checkpoint("tiny-sd3")),
        "rollout_batch_size": 2,
        "n_samples_per_prompt": 4,
        "rollout_microgroup_size": 4,
        "global_batch_size": 8,
        "diffusion_num_steps": 4,
        "diffusion_num_sde_steps": 2,
        "diffusion_sde_window_range": "0,4",
        "use_lora": True,
        "lora_rank": opts.lora_rank,
        "lora_alpha": 2 * opts.lora_rank,
        "lora_ipc_weight_sync": True,
        "colocate": True,
        "lr": 1e-2,
    }
    args = resolve("rl", recipe="tiny-digits-grpo", cli=cli).args
    init_ray(args)
    try:
        full_manager, lora_manager = (manager_actor_class().options(num_cpus=0).remote(args, None, True) for _ in "ab")
        group = TrainerGroup(args, "actor", total_steps=10)
        batch = ray.get(full_manager.generate.remote(0))
        group.train(0, batch.samples)

        merged = group.engine_weights()
        payload = group.weights_for_sync()
        assert all("lora_" in name for name in payload)
        ray.get(full_manager.update_weights.remote(merged, 1))
        ray.get(lora_manager.update_weights.remote(payload, 1))
        for manager in (full_manager, lora_manager):
            served = ray.get(manager.engine_state_dict.remote())
            diff = max((served[k] - merged[k]).abs().max().item() for k in merged)
            assert served.keys() == merged.keys() and diff == 0.0, diff

        medians = interleaved_medians(
            {
                "full": lambda: ray.get(full_manager.update_weights.remote(group.engine_weights(), 2)),
                "lora": lambda: ray.get(lora_manager.update_weights.remote(group.weights_for_sync(), 2)),
            },
            opts.repeats,
        )
    finally:
        ray.shutdown()

    def nbytes(state: dict) -> int:
        return sum(t.numel() * t.element_size() for t in state.values())

    full_b, lora_b = nbytes(merged), nbytes(payload)
    print(f"tiny-sd3, LoRA r={opts.lora_rank}: both engines serve the trainer's merged weights exactly")
    print(f"full sync       {len(merged):4d} tensors {full_b / 1024:9.1f} KiB  {1e3 * medians['full']:8.2f} ms")
    print(f"LoRA-only sync  {len(payload):4d} tensors {lora_b / 1024:9.1f} KiB  {1e3 * medians['lora']:8.2f} ms")
    print(f"bytes {full_b / lora_b:.1f}x smaller, time ratio LoRA / full {medians['lora'] / medians['full']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
