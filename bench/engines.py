"""Rollout throughput: the in-process diffusers engine against one sglang-diffusion server, same requests.

Both generate the same microgroups of tiny-sd3 (64x64, CFG, SDE steps with log-probs, trajectories and
conditions returned) from the same seeds. The diffusers side is the engine `miles` runs on CPU (in this
process, every core); the sglang side is the whole client path of `--rollout-backend sglang`: the miles
router, one server from the sglang environment (every core), msgpack decoding in a parser actor.
Prints images/s of each and the ratio sglang / diffusers (medians of interleaved runs).

    python bench/engines.py [--prompts 8] [--samples 8] [--steps 10] [--repeats 5]
"""

from __future__ import annotations

import argparse
import sys
import tempfile

from bench_timing import interleaved_medians


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    opts = parser.parse_args()

    import ray

    from miles.builtin.checkpoints import ensure_checkpoint
    from miles.config.resolve import resolve
    from miles.rollout.manager import RolloutManager, build_requests
    from miles.utils.sglang_env import resolve_sglang_python

    if resolve_sglang_python(None) is None:
        print("bench/engines.py: no sglang environment (bash scripts/build_sglang_env.sh)", file=sys.stderr)
        return 2
    cli = {
        "hf_checkpoint": str(ensure_checkpoint("tiny-sd3")),
        "rollout_batch_size": opts.prompts,
        "n_samples_per_prompt": opts.samples,
        "rollout_microgroup_size": opts.samples,
        "global_batch_size": opts.prompts * opts.samples,
        "micro_batch_size": opts.prompts * opts.samples,
        "diffusion_num_steps": opts.steps,
        "diffusion_num_sde_steps": opts.steps - 1,
        "diffusion_sde_window_range": f"0,{opts.steps - 1}",
        "output_dir": tempfile.mkdtemp(prefix="miles_bench_engines_"),
    }
    diffusers_args = resolve("rl", recipe="tiny-digits-grpo", cli={**cli, "rollout_backend": "diffusers"}).args
    sglang_args = resolve("rl", recipe="tiny-digits-grpo", cli={**cli, "rollout_backend": "sglang"}).args
    ray.init(include_dashboard=False, log_to_driver=False)
    local = RolloutManager(diffusers_args)
    served = RolloutManager(sglang_args, use_ray_engines=True)
    try:
        groups = local.data_source.get_samples(opts.prompts)
        requests = build_requests(diffusers_args, groups, local.strategy)
        images = sum(len(r.seeds) for r in requests)
        medians = interleaved_medians(
            {
                "diffusers": lambda: local.run_requests(requests),
                "sglang": lambda: served.run_requests(requests),
            },
            opts.repeats,
        )
        start = served.engine_info()[0]["start_seconds"]
    finally:
        served.shutdown()
        ray.shutdown()
    rate = {name: images / seconds for name, seconds in medians.items()}
    print(f"requests: {len(requests)} microgroups x {opts.samples} = {images} images, {opts.steps} steps, CFG")
    for name in ("diffusers", "sglang"):
        print(f"{name:>9}: {medians[name]:.3f} s  {rate[name]:.1f} images/s")
    print(f"ratio sglang / diffusers: {rate['sglang'] / rate['diffusers']:.2f}x images/s")
    print(f"sglang server start (load + warm-up): {start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
