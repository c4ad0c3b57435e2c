"""The memory plan's speed: `miles plan` on the acceptance recipes from the shipped counts and traces (a fresh
interpreter each, no torch), and one real-size trace (SD3.5-Medium's step of sd3-ocr-grpo: 2 CFG pairs at 512 px,
LoRA r32, forward and backward on fake tensors) against the same fake step without the tracker (the plain-library
baseline: FakeTensorMode alone), so the ratio is what the tracking costs.

    python bench/memory_plan.py
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ("sd35-4step", "sd3-ocr-grpo", "wan22-pickscore-grpo", "qwen-image-pickscore-grpo")


def plan_seconds(recipe: str, home: str) -> float:
    env = {**os.environ, "MILES_HOME": home, "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", f"from miles_cli.main import main; main(['plan', '--recipe', {recipe!r}])"],
        env=env,
        capture_output=True,
        check=False,
    )
    return time.perf_counter() - start


def trace_vs_plain() -> tuple[float, float, float]:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from miles.config.resolve import resolve
    from miles.memory.activations import GuidedStep, materialize, step_inputs, step_module, trace_step
    from miles.memory.config_dirs import config_dir_for
    from miles.memory.step import read_configs, train_spec
    from miles.models.families import args_family
    from miles.models.pipeline_config import target_components

    args = resolve(None, recipe="sd3-ocr-grpo").args
    family = args_family(args)
    config_dir = config_dir_for(args.hf_checkpoint, family)
    components = family.denoiser_components(target_components(args.update_weight_target_module))
    spec = train_spec(args, family, read_configs(config_dir), components)
    start = time.perf_counter()
    traced = trace_step(config_dir, family, spec)
    ours = time.perf_counter() - start

    start = time.perf_counter()
    dtype = getattr(torch, spec.forward_dtype)
    model = step_module(config_dir, family, spec, dtype)
    with FakeTensorMode():
        materialize(model)
        x, t, cond = step_inputs(spec, dtype)
        GuidedStep(model, family, 4.5 if spec.cfg else None)(x, t, cond).float().pow(2).mean().backward()
    plain = time.perf_counter() - start
    return ours, plain, traced["transient_peak"] / 1024**3


def main() -> int:
    with tempfile.TemporaryDirectory() as home:
        for recipe in RECIPES:
            runs = [plan_seconds(recipe, home) for _ in range(3)]
            print(f"miles plan --recipe {recipe:28s} {statistics.median(runs):.2f} s (median of 3, shipped traces)")
    ours, plain, gib = trace_vs_plain()
    print(f"trace of SD3.5-Medium's sd3-ocr-grpo step: {ours:.1f} s ({gib:.2f} GiB of activations)")
    print(f"the same fake step without the tracker:     {plain:.1f} s   ratio {ours / plain:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
