"""Benchmark: the digits edit SFT's ceiling under tiny-flux-kontext's VAE (the targets' round trip).

    python bench/kontext_vae_ceiling.py [--steps 300 1000 2000] [--batch-size 8] [--lr 3e-3] [--seed 0] [--threads N]
    python bench/kontext_vae_ceiling.py --checkpoint ~/.cache/miles/models/tiny-flux-kontext   # a built VAE

An SFT that reproduces the data's targets scores what they score after the VAE's round trip, since the model's
samples are decoded by it: this scores the 360 test targets of `digits-edit:sft-test` (48-px digits b pasted at
the source's place) with `digit_edit` against their sources, as they are, then encoded (posterior mean, as the
SFT encodes its targets) and decoded (as the engine decodes a sample: `(x / 2 + 0.5).clamp(0, 1)`). Each setting
fits a fresh VAE exactly as `build_tiny_flux_kontext` does (the same initial weights, the same training images:
the full-canvas and the pasted train digits, `fit_vae` with the build's seed); the digit classifier is the one
every tiny build fits and saves (`fit_digit_classifier()`). Prints, per setting, the fit time, the test MSE of
the build's own test images, the mean reward (with its factors) and the accuracy on the crop `digit_edit` reads.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path


def load_rows() -> tuple[list, list, list[int]]:
    """The sft-test targets and sources as uint8 (H, W, 3) arrays, and the target digits."""
    import numpy as np
    from PIL import Image

    from miles.builtin.datasets import resolve_dataset

    path = resolve_dataset("digits-edit:sft-test")
    targets, sources, labels = [], [], []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        targets.append(np.asarray(Image.open(path.parent / row["image"]).convert("RGB")))
        sources.append(np.asarray(Image.open(path.parent / row["media"][0]["image"]).convert("RGB")))
        labels.append(int(row["metadata"]["label"]))
    return targets, sources, labels


def round_trip(vae, targets: list) -> list:
    """uint8 (H, W, 3) images -> the VAE's reconstructions (posterior mean), (3, H, W) float in [0, 1]."""
    import numpy as np
    import torch

    from miles.builtin.tiny import vae_fit

    pixels = torch.from_numpy(np.stack(targets)).permute(0, 3, 1, 2).float() / 255.0 * 2.0 - 1.0
    recon = vae_fit.reconstruct(vae, pixels)
    return list((recon / 2 + 0.5).clamp(0, 1).numpy())


def score(images: list, sources: list, labels: list[int], classifier) -> dict[str, float]:
    import numpy as np

    from miles.models.digit_classifier import digits_to_features
    from miles.rewards.scorers.digit_edit import edit_crops, edit_terms

    terms = edit_terms(images, sources, labels, classifier)
    crops = edit_crops(images, sources)
    predicted = classifier.predict(digits_to_features(crops))
    return {
        "reward": float(np.mean([t.reward for t in terms])),
        "p_b": float(np.mean([t.p_label for t in terms])),
        "place": float(np.mean([t.place for t in terms])),
        "size": float(np.mean([t.size for t in terms])),
        "accuracy": float(np.mean(np.asarray(predicted) == np.asarray(labels))),
    }


def fitted_vae(steps: int, batch_size: int, lr: float, seed: int) -> tuple[object, float, float]:
    """A VAE fitted as tiny-flux-kontext's build fits it (with these steps, batch size and lr): (vae, fit seconds,
    test MSE on the build's test images)."""
    import torch

    from miles.builtin.tiny import vae_fit
    from miles.builtin.tiny.flux_kontext import TinyFluxKontextBuild

    build = TinyFluxKontextBuild(Path(tempfile.gettempdir()) / "unused", seed, steps)
    build.data()
    vae = build.make_vae()
    options = {**build.fit_options(), "batch_size": batch_size, "lr": lr}
    t0 = time.perf_counter()
    vae_fit.fit_vae(vae, build.train, steps=steps, seed=seed, **options)
    seconds = time.perf_counter() - t0
    mse = float(torch.nn.functional.mse_loss(vae_fit.reconstruct(vae, build.test), build.test))
    return vae, seconds, mse


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, nargs="*", default=[300], help="VAE fit steps, one setting each")
    parser.add_argument("--batch-size", type=int, default=None, help="default: the build's (VAE_BATCH_SIZE)")
    parser.add_argument("--lr", type=float, default=None, help="default: the build's (VAE_LR)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--checkpoint", type=Path, default=None, help="score this build's VAE instead of fitting")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

    import torch

    from miles.builtin.tiny.vae_fit import VAE_BATCH_SIZE, VAE_LR

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    from miles.models.digit_classifier import fit_digit_classifier

    batch_size = VAE_BATCH_SIZE if args.batch_size is None else args.batch_size
    lr = VAE_LR if args.lr is None else args.lr
    targets, sources, labels = load_rows()
    classifier, _ = fit_digit_classifier()
    print(f"tiny-flux-kontext VAE ceiling (torch threads {torch.get_num_threads()}, {len(targets)} test targets)")

    def line(label: str, s: dict[str, float], extra: str = "") -> None:
        print(
            f"  {label:<34} digit_edit {s['reward']:.4f} (p_b {s['p_b']:.3f}, place {s['place']:.3f}, "
            f"size {s['size']:.3f}; accuracy {s['accuracy']:.3f}){extra}",
            flush=True,
        )

    line("targets as they are", score(targets, sources, labels, classifier))
    if args.checkpoint is not None:
        from diffusers import AutoencoderKL

        vae = AutoencoderKL.from_pretrained(args.checkpoint.expanduser() / "vae").eval()
        line(f"round trip, {args.checkpoint.name}", score(round_trip(vae, targets), sources, labels, classifier))
        return 0
    for steps in args.steps:
        vae, seconds, mse = fitted_vae(steps, batch_size, lr, args.seed)
        s = score(round_trip(vae, targets), sources, labels, classifier)
        line(f"round trip, {steps} steps, batch {batch_size}, lr {lr:g}", s, f"; fit {seconds:.1f} s, mse {mse:.5f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
