"""Weight sync, as `miles train rl` runs it: copies through Ray's object store against in place by handle
(--colocate), for full weights and for only the LoRA tensors.

Two trainer ranks (Ray actors, one per payload kind) train tiny-sd3 for one step; two rollout managers (Ray
actors, each with its own engine) receive their weights. Each payload goes both ways:

    copy       trainer actor -> driver -> manager -> engine (the sync without --colocate); sglang engines
               then load the weights from safetensors files (/update_weights_from_disk, /v1/set_lora)
    in place   trainer rank -> engine, handles only: the engine reads the weights from the trainer's
               buckets (shared memory here, CUDA IPC on GPUs; `miles.models.weight_ipc`); sglang engines
               through /update_weights_from_tensor

Payload kinds: `--backend diffusers` (the in-process engine as a Ray actor): the full LoRA-merged transformer
and the LoRA-only payload of --lora-ipc-weight-sync, both from a LoRA r=`--lora-rank` trainer; `--backend
sglang` (one CPU server per manager): a full fine-tune's weights and a LoRA trainer's adapter (sglang always
takes LoRA as the adapter). The bench first checks each path (diffusers: the engine serves exactly the
trainer's merged weights; sglang: every parameter verified by the server's checker), then times one sync
each way (the `perf/sync_time` of `train rl`: gather on the trainer, transfer, load or merge, and on sglang
the verification) as medians of interleaved runs, and prints the bytes copied through Ray against the bytes
passed by handle.

    python bench/weight_sync.py [--backend diffusers|sglang] [--lora-rank 4] [--repeats 7]
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
from typing import Any

from bench_timing import interleaved_medians


def job_args(backend: str, kind: str, lora_rank: int, out: str) -> Any:
    from miles.builtin.checkpoints import ensure_checkpoint
    from miles.config.resolve import resolve

    cli: dict[str, Any] = {
        "hf_checkpoint": str(ensure_checkpoint("tiny-sd3")),
        "rollout_batch_size": 2,
        "n_samples_per_prompt": 4,
        "rollout_microgroup_size": 4,
        "global_batch_size": 8,
        "diffusion_num_steps": 4,
        "diffusion_num_sde_steps": 2,
        "diffusion_sde_window_range": "0,4",
        "colocate": True,
        "lr": 1e-2,
        "rollout_backend": backend,
        "output_dir": f"{out}/{kind}",
    }
    if backend == "diffusers" or kind == "lora":
        cli.update(use_lora=True, lora_rank=lora_rank, lora_alpha=2 * lora_rank)
    if backend == "diffusers" and kind == "lora":
        cli["lora_ipc_weight_sync"] = True
    return resolve("rl", recipe="tiny-digits-grpo", cli=cli).args


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("diffusers", "sglang"), default="diffusers")
    parser.add_argument("--lora-rank", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=7)
    opts = parser.parse_args()

    import ray

    from miles.rollout.manager import manager_actor_class
    from miles.runtime.ray_setup import init_ray
    from miles.runtime.train_rl import sync_weights
    from miles.runtime.trainer_group import TrainerGroup

    sglang = opts.backend == "sglang"
    kinds = ("full", "lora")
    args = {kind: job_args(opts.backend, kind, opts.lora_rank, tempfile.mkdtemp()) for kind in kinds}
    init_ray(args["full"])
    managers: dict[str, Any] = {}
    try:
        managers = {kind: manager_actor_class().options(num_cpus=0).remote(args[kind], None, True) for kind in kinds}
        groups = {kind: TrainerGroup(args[kind], "actor", total_steps=10) for kind in kinds}
        batch = ray.get(managers["full"].generate.remote(0))
        for group in groups.values():
            group.train(0, batch.samples)
        payloads = {kind: groups[kind].weights_for_sync() for kind in kinds}
        assert all("lora_" in name for name in payloads["lora"])
        merged = {kind: groups[kind].engine_weights() for kind in kinds}
        versions = itertools.count(2)  # sglang names each LoRA version's adapter

        def copy(kind: str) -> Any:
            return lambda: ray.get(
                managers[kind].update_weights.remote(groups[kind].weights_for_sync(), next(versions))
            )

        def in_place(kind: str) -> Any:
            return lambda: sync_weights(managers[kind], groups[kind], next(versions))  # --colocate: by handle

        cases = {f"{way} {kind}": fn(kind) for kind in kinds for way, fn in (("copy", copy), ("ipc", in_place))}
        handles: dict[str, dict[str, float]] = {}
        for name, case in cases.items():
            case()
            kind = name.split()[1]
            metrics = ray.get(managers[kind].sync_metrics.remote())
            if sglang:  # both paths end in the server's per-parameter check
                assert metrics["sync/verified_tensors"] == 66.0 and metrics["sync/engines_agree"] == 1.0, name
            else:
                served = ray.get(managers[kind].engine_state_dict.remote())
                diff = max((served[k] - merged[kind][k]).abs().max().item() for k in merged[kind])
                assert served.keys() == merged[kind].keys() and diff == 0.0, (name, diff)
            if name.startswith("ipc"):
                handles[kind] = metrics
        medians = interleaved_medians(cases, opts.repeats)
    finally:
        for manager in managers.values():
            ray.get(manager.shutdown.remote())
        ray.shutdown()
    report(opts, payloads, handles, medians)
    return 0


def report(opts: Any, payloads: dict[str, Any], handles: dict[str, dict[str, float]], medians: dict[str, float]):
    def nbytes(state: dict) -> int:
        return sum(t.numel() * t.element_size() for t in state.values())

    def kib(n: float) -> str:
        return f"{n / 1024:,.1f} KiB"

    sglang = opts.backend == "sglang"
    labels = {"full": "full" if sglang else "full merged", "lora": "LoRA adapter" if sglang else "LoRA-only"}
    copy_way = "object store + disk" if sglang else "object store"
    checked = "every parameter verified by the server" if sglang else "the engine serves the trainer's weights exactly"
    print(f"tiny-sd3 on {opts.backend} engines, LoRA r={opts.lora_rank}: after every path {checked}")
    print(f"{'path':<36}{'tensors':>8}{'copied through Ray':>20}{'passed by handle':>18}{'time':>12}")
    for kind in ("full", "lora"):
        copy, ipc, stats = medians[f"copy {kind}"], medians[f"ipc {kind}"], handles[kind]
        copied = nbytes(payloads[kind])
        row = f"{copy_way + ', ' + labels[kind]:<36}{len(payloads[kind]):>8}{kib(copied):>20}{'-':>18}"
        print(f"{row}{1e3 * copy:>9.2f} ms")
        row = f"{'in place, ' + labels[kind]:<36}{int(stats['sync/tensors']):>8}"
        row += f"{kib(stats['sync/bytes_serialized']):>20}{kib(stats['sync/bytes_by_handle']):>18}"
        print(f"{row}{1e3 * ipc:>9.2f} ms")
        print(
            f"  {labels[kind]}: in place / {copy_way} time {ipc / copy:.2f}x; "
            f"{copied / stats['sync/bytes_serialized']:.0f}x fewer bytes through Ray"
        )
    print(f"LoRA payload / full payload: {nbytes(payloads['full']) / nbytes(payloads['lora']):.1f}x fewer bytes")


if __name__ == "__main__":
    sys.exit(main())
