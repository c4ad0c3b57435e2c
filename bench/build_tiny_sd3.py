"""Benchmark: build tiny-sd3 from scratch into a temp dir (goal: under 2 minutes on 2 CPU cores).

    python bench/build_tiny_sd3.py [--seed 0] [--keep DIR]

Prints the wall time (imports included and excluded), the per-phase times, the digit classifier's
test accuracy and the VAE's reconstruction quality.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

GOAL_SECONDS = 120.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", type=Path, default=None, help="build here and keep it (must not exist)")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

    t0 = time.perf_counter()
    import diffusers  # noqa: F401  (the import cost is part of a first build)
    import torch

    from miles.builtin.tiny.sd3 import build_tiny_sd3

    import_s = time.perf_counter() - t0
    tmp = None
    if args.keep is None:
        tmp = Path(tempfile.mkdtemp(prefix="bench-tiny-sd3-"))
        out = tmp / "tiny-sd3"
    else:
        out = args.keep
    try:
        report = build_tiny_sd3(out, seed=args.seed, progress=False)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    wall = time.perf_counter() - t0
    print(f"tiny-sd3 build (seed {args.seed}, torch threads {torch.get_num_threads()}, cpus {os.cpu_count()})")
    print(f"  wall time        {wall:7.2f} s   (imports {import_s:.2f} s + build {report.seconds:.2f} s)")
    for phase, seconds in report.phase_seconds.items():
        print(f"    {phase:<14} {seconds:7.2f} s")
    print(f"  classifier test accuracy      {report.classifier_test_accuracy:.4f}")
    print(f"  vae test mse ([-1,1])         {report.vae_test_mse:.5f}")
    print(f"  accuracy on vae reconstructions {report.vae_recon_accuracy:.4f}")
    print(f"  params {report.params}")
    verdict = "PASS" if wall < GOAL_SECONDS else "SLOW"
    print(f"  goal < {GOAL_SECONDS:.0f} s: {verdict} ({wall / GOAL_SECONDS:.2f}x of the budget)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
