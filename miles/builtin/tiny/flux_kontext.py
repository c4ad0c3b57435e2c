"""`build_tiny_flux_kontext(out_dir, seed)`: tiny-flux's architecture loaded by `FluxKontextPipeline`, for editing.

The same components and seeds as tiny-flux (`miles.builtin.tiny.flux`), saved as a `FluxKontextPipeline`
directory, except the VAE: it is fitted to the full-canvas digits *and* to the edit task's sources (a 48-pixel
digit pasted at an offset of the 64-pixel canvas, `miles.data.digits_edit`); tiny-flux's VAE, fitted to
full-canvas digits alone, reconstructed the task's first (32-pixel) sources poorly (the digit classifier read 48 %
of them after its round trip).
The transformer is random: the digits edit SFT start point learns the edit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from miles.builtin.tiny.build import BuildReport
from miles.builtin.tiny.flux import TinyFluxBuild
from miles.builtin.tiny.vae_fit import VAE_STEPS
from miles.models.tiny.metadata import current_design

__all__ = ["TINY_FLUX_KONTEXT_NAME", "BuildReport", "build_tiny_flux_kontext"]

TINY_FLUX_KONTEXT_NAME = "tiny-flux-kontext"
SGLANG_MODEL_ID = "FLUX.1-Kontext-dev"
PASTE_SEED = 4321  # the offsets of the pasted digits the VAE also fits
# T5 tokens of an edit instruction: "make it a 5" is 9 with </s> (the offline tokenizers know the digit prompts'
# words and spell the others letter by letter; "change the 3 into a 5" is 15); tiny-flux's 8 would cut the digit off
MAX_SEQUENCE_LENGTH = 16


def pasted_digits_vae_input(x8: Any, seed: int = PASTE_SEED) -> Any:
    """(N, 8, 8) digits -> (N, 3, 64, 64) in [-1, 1]: each a DIGIT_PIXELS digit at a random offset (the edit
    task's sources)."""
    import numpy as np
    import torch

    from miles.data.digits_edit import CANVAS, DIGIT_PIXELS, paste

    rng = np.random.default_rng(seed)
    offsets = rng.integers(0, CANVAS - DIGIT_PIXELS + 1, size=(len(x8), 2))
    gray = np.stack([paste(d, (int(r), int(c))) for d, (r, c) in zip(x8, offsets, strict=True)])
    return (torch.from_numpy(gray) * 2.0 - 1.0)[:, None].expand(-1, 3, -1, -1).contiguous()


class TinyFluxKontextBuild(TinyFluxBuild):
    """tiny-flux's phases; the VAE also fits the pasted digits; saved as a FluxKontextPipeline."""

    name = TINY_FLUX_KONTEXT_NAME
    sglang_model_id = SGLANG_MODEL_ID
    pipeline_class = "FluxKontextPipeline"

    def data(self) -> None:
        import torch

        super().data()
        self.train = torch.cat([self.train, pasted_digits_vae_input(self.split.train_x)])

    def metadata(self, report: BuildReport) -> dict[str, Any]:
        # the design: a cached build of another one is rebuilt (miles.builtin.checkpoints)
        design = current_design(self.name)
        return {**super().metadata(report), "max_sequence_length": MAX_SEQUENCE_LENGTH, "design": design}


def build_tiny_flux_kontext(
    out_dir: str | Path, seed: int = 0, progress: bool = True, vae_steps: int = VAE_STEPS
) -> BuildReport:
    """Build tiny-flux-kontext into `out_dir` (which must not exist, or be empty); return timings and accuracies."""
    return TinyFluxKontextBuild.build(out_dir, seed, progress, vae_steps)
