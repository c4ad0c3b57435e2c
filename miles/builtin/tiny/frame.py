"""`TinyBuild`: the one frame of every offline tiny build; a family's build is a subclass that fills the phases.

`run(progress)` runs `phases` in order, each timed and shown on the progress bar, by calling the method of the
phase's name (`"text encoders"` -> `text_encoders()`); then counts the saved pipeline's parameters and writes
the metadata the family's `metadata(report)` returns. The phases share state on `self`:

    tokenizers, text_encoders, transformer   make the components (each seeded on its own, `components.seeded`)
    data                                     the digits (or moving digits) the VAE is fitted to
    vae_fit                                  fit `self.vae`; `self.vae_step` advances the bar once per step
    vae_stats                                latent statistics and test reconstructions (`self.vae_mse`)
    classifier                               fit and save the digit classifier, score the reconstructions
    save                                     `pipeline()` assembled and saved with `save_pretrained`

Torch is imported by the phases, never at import time.
"""

from __future__ import annotations

import json
import time
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

from miles.builtin.tiny.build import (
    PHASES,
    BuildReport,
    Progress,
    build_atomically,
    library_versions,
    phase_timer,
    pipeline_report,
)
from miles.models.tiny.metadata import TINY_METADATA_FILE


class TinyBuild:
    name = "tiny"
    metadata_file = TINY_METADATA_FILE
    phases: tuple[str, ...] = PHASES

    def __init__(self, out: Path, seed: int, vae_steps: int) -> None:
        self.out = out
        self.seed = seed
        self.vae_steps = vae_steps
        self.bar: Progress | None = None
        self.vae: Any = None
        self.pipe: Any = None
        self.classifier_meta: dict[str, Any] = {}
        self.vae_mse = 0.0
        self.recon_accuracy = 0.0

    # ---- the phases a family fills (text encoders and save have defaults) -------------------------------
    def text_encoders(self) -> None:
        """Nothing by default (a family whose text encoder comes with its tokenizer)."""

    def pipeline(self) -> Any:
        raise NotImplementedError

    def save(self) -> None:
        from miles.models.loading import quiet_loading

        self.pipe = self.pipeline()
        with quiet_loading():
            self.pipe.save_pretrained(self.out)

    def metadata(self, report: BuildReport) -> dict[str, Any]:
        """What the build's metadata file holds before `report_fields(report)` (the timings and versions)."""
        raise NotImplementedError

    def vae_fit_fields(self, batch_size: int, lr: float) -> dict[str, Any]:
        """The fit and its scores: the last fields of an image or digit-frames build's `vae` metadata entry."""
        return {
            "fit_steps": self.vae_steps,
            "batch_size": batch_size,
            "lr": lr,
            "test_mse": round(self.vae_mse, 6),
            "test_reconstruction_accuracy": self.recon_accuracy,
        }

    # ---- the VAE: made, fitted to `self.train`, normalised, and scored on `self.test` -----------------
    recon_batch_size = 64  # the reconstructions' encode/decode batch

    def make_vae(self) -> Any:
        raise NotImplementedError

    def fit_options(self) -> dict[str, Any]:
        """`fit_vae`'s keyword arguments beyond steps and seed (batch size, lr, decode) the family changes."""
        return {}

    def vae_context(self) -> AbstractContextManager[Any]:
        """What the fit, the statistics and the reconstructions run under (qwen_image's 2-D convs)."""
        return nullcontext()

    def latent_stats(self) -> None:
        """Normalise the VAE's latents on the training data (the family's convention)."""
        raise NotImplementedError

    def vae_fit(self) -> None:
        from miles.builtin.tiny import vae_fit

        self.vae = self.make_vae()
        with self.vae_context():
            vae_fit.fit_vae(
                self.vae, self.train, steps=self.vae_steps, seed=self.seed, on_step=self.vae_step, **self.fit_options()
            )

    def vae_stats(self) -> None:
        import torch

        from miles.builtin.tiny import vae_fit

        with self.vae_context():
            self.latent_stats()
            self.recon = vae_fit.reconstruct(self.vae, self.test, batch_size=self.recon_batch_size)
            self.vae_mse = float(torch.nn.functional.mse_loss(self.recon, self.test))

    # ---- the frame ----------------------------------------------------------------------------------
    def vae_step(self, step: int, loss: float) -> None:
        assert self.bar is not None
        self.bar.advance()

    @classmethod
    def build(cls, out_dir: str | Path, seed: int, progress: bool, vae_steps: int) -> BuildReport:
        """Build into `out_dir` (which must not exist, or be empty; `build_atomically`): timings and accuracies."""
        return build_atomically(out_dir, lambda tmp: cls.build_into(tmp, seed, progress, vae_steps))

    @classmethod
    def build_into(cls, tmp: Path, seed: int, progress: bool, vae_steps: int) -> BuildReport:
        """The build in the temporary folder `tmp` that `build` renames into place."""
        return cls(tmp, seed, vae_steps).run(progress)

    def run(self, progress: bool) -> BuildReport:
        start = time.perf_counter()
        timings: dict[str, float] = {}
        with Progress(progress, self.vae_steps, label=self.name, phases=self.phases) as bar:
            self.bar = bar
            phase = phase_timer(timings, bar)
            for name in self.phases:
                with phase(name, advance=name != "vae fit"):  # the fit advances once per step
                    getattr(self, name.replace(" ", "_"))()
            report = pipeline_report(
                self.pipe,
                self.out,
                start,
                timings,
                self.classifier_meta["test_accuracy"],
                self.vae_mse,
                self.recon_accuracy,
            )
            meta = {**self.metadata(report), **report_fields(report)}
            (self.out / self.metadata_file).write_text(json.dumps(meta, indent=2) + "\n")
            bar.describe("done")
        return report


def report_fields(report: BuildReport) -> dict[str, Any]:
    """The last fields of every tiny build's metadata: its parameters, timings and library versions."""
    return {
        "params": report.params,
        "build_seconds": report.seconds,
        "phase_seconds": report.phase_seconds,
        "versions": library_versions(),
    }


class DigitsImageBuild(TinyBuild):
    """The phases tiny-sd3 and tiny-flux share: their CLIP and T5 tokenizers, and tiny-sd3's 8x AutoencoderKL
    fitted to the 64x64 digits (so the same seed gives both the same VAE), with its latent shift and scale."""

    sglang_model_id = ""

    def tokenizers(self) -> None:
        from miles.models.tiny.tokenizers import build_clip_tokenizer, build_t5_tokenizer

        self.clip_tok, self.t5_tok = build_clip_tokenizer(), build_t5_tokenizer()
        clip, t5 = self.clip_tok, self.t5_tok
        self.ids = {
            "clip_vocab_size": len(clip),
            "clip_bos_id": clip.bos_token_id,
            "clip_eos_id": clip.eos_token_id,
            "clip_pad_id": clip.pad_token_id,
            "t5_vocab_size": len(t5),
            "t5_pad_id": t5.pad_token_id,
            "t5_eos_id": t5.eos_token_id,
        }

    def data(self) -> None:
        from miles.builtin.tiny import vae_fit
        from miles.data.digits import load_digits_split

        self.split = load_digits_split()
        self.train = vae_fit.digits_to_vae_input(self.split.train_x)
        self.test = vae_fit.digits_to_vae_input(self.split.test_x)

    def make_vae(self) -> Any:
        from miles.builtin.tiny import components as C

        return C.make_vae(self.seed)

    def latent_stats(self) -> None:
        from miles.builtin.tiny import vae_fit

        self.shift, self.scale = vae_fit.set_latent_normalization(self.vae, self.train)

    def classifier(self) -> None:
        from miles.builtin.tiny.build import score_and_save_classifier

        self.classifier_meta, self.recon_accuracy = score_and_save_classifier(self.out, self.recon, self.split.test_y)

    def metadata(self, report: BuildReport) -> dict[str, Any]:
        from miles.builtin.tiny import components as C
        from miles.builtin.tiny.vae_fit import VAE_BATCH_SIZE, VAE_LR
        from miles.data.digits import PROMPT_TEMPLATE, SPLIT_SEED
        from miles.models.tiny.metadata import FORMAT_VERSION, TINY_MAX_SEQUENCE_LENGTH
        from miles.models.tiny.tokenizers import CLIP_MAX_LENGTH

        return {
            "name": self.name,
            "format_version": FORMAT_VERSION,
            "seed": self.seed,
            "resolution": C.IMAGE_SIZE,
            "latent_size": C.LATENT_SIZE,
            "latent_channels": C.LATENT_CHANNELS,
            "max_sequence_length": TINY_MAX_SEQUENCE_LENGTH,
            "clip_max_length": CLIP_MAX_LENGTH,
            "prompt_template": PROMPT_TEMPLATE,
            "data": {"name": "digits", "split_seed": SPLIT_SEED},
            "sglang_model_id": self.sglang_model_id,
            "vae": {
                "shift_factor": self.shift,
                "scaling_factor": self.scale,
                **self.vae_fit_fields(VAE_BATCH_SIZE, VAE_LR),
            },
            "digit_classifier": {"path": "digit_classifier", "test_accuracy": report.classifier_test_accuracy},
        }


class DigitFramesBuild(TinyBuild):
    """The digits as one-frame videos, for a video VAE fitted to still images (tiny-qwen-image, tiny-cosmos3);
    the image digit classifier scores each reconstruction's frame."""

    def data(self) -> None:
        from miles.builtin.tiny.video_vae import digits_to_video_input
        from miles.data.digits import load_digits_split

        self.split = load_digits_split()
        self.train = digits_to_video_input(self.split.train_x)  # [N, 3, 1, 64, 64]
        self.test = digits_to_video_input(self.split.test_x)

    def latent_stats(self) -> None:
        from miles.builtin.tiny import vae_fit

        self.latents_mean, self.latents_std = vae_fit.set_latents_mean_std(self.vae, self.train)

    def classifier(self) -> None:
        from miles.builtin.tiny.build import score_and_save_classifier

        recon = self.recon[:, :, 0]  # frame 0 of each
        self.classifier_meta, self.recon_accuracy = score_and_save_classifier(self.out, recon, self.split.test_y)


class MovingDigitsBuild(TinyBuild):
    """The moving-digit videos (tiny-wan2_2, tiny-ltx2): a video VAE fitted to `num_frames`-frame videos, its
    latent statistics from the first `stats_videos` of them, the video digit classifier (digit per frame, and
    the tracked direction) on its reconstructions."""

    num_frames = 9
    stats_videos = 256
    recon_batch_size = 32

    def data(self) -> None:
        from miles.builtin.tiny import vae_fit
        from miles.data.digits import load_digits_split

        self.split = load_digits_split()
        self.train, _ = vae_fit.digit_videos_to_vae_input(self.split.train_x, self.num_frames)
        self.test, self.test_directions = vae_fit.digit_videos_to_vae_input(self.split.test_x, self.num_frames)

    def classifier(self) -> None:
        from miles.builtin.tiny.build import score_and_save_video_classifier

        self.classifier_meta, self.recon_accuracy, self.direction_accuracy = score_and_save_video_classifier(
            self.out, self.recon, self.split.test_y, self.test_directions
        )

    def vae_metadata(self, temporal: int, spatial: int, batch_size: int, lr: float) -> dict[str, Any]:
        """The `vae` entry of a moving-digits build's metadata."""
        return {
            "latents_mean": self.latents_mean,
            "latents_std": self.latents_std,
            "temporal_compression": temporal,
            "spatial_compression": spatial,
            "fit_steps": self.vae_steps,
            "batch_size": batch_size,
            "lr": lr,
            "stats_videos": self.stats_videos,
            "test_mse": round(self.vae_mse, 6),
            "test_reconstruction_accuracy": self.recon_accuracy,  # per frame (the video classifier on each frame)
            "test_direction_accuracy": self.direction_accuracy,  # track_direction(decoded) == the video's direction
        }
