"""Shared fixtures. Nothing in the test session may download: the HF hubs are forced offline.

Session fixtures (built once, reused by every test directory):
  miles_session_home   $MILES_HOME for the whole session (a temp dir, or $MILES_TEST_HOME; autouse)
  tiny_sd3_dir         tiny-sd3 built once at $MILES_HOME/models/tiny-sd3, so
                       `ensure_checkpoint("tiny-sd3")` finds it too (treat it as read-only)
  tiny_sd3_pipeline    StableDiffusion3Pipeline.from_pretrained(tiny_sd3_dir) (read-only; copy to mutate)
  tiny_flux_dir / tiny_qwen_image_dir / tiny_wan2_2_dir / tiny_ltx2_dir   the other tiny families, built once
  tiny_flux2_klein_dir / tiny_z_image_dir   tiny-flux2-klein / tiny-z-image with a 10-step VAE fit (their layout)
                       the same way (read-only)
  digit_classifier     the checkpoint's digit classifier
  digits_split         the deterministic digits train/test split
  tiny_clip            a tiny random CLIP model + processor saved offline (PickScore's shape)
  diffusers_rollouts   one `miles rollout-only` run on the in-process engine (2 small rollouts), read by the
                       rollout-only, replay and sglang-comparison tests (treat it as read-only)
  small_digit_eval     `--eval-prompt-data digits FILE`: one prompt per digit, for jobs whose recipe evaluates
                       digits:test (360 prompts, ~20 s) after its last rollout and whose test is not about that
Module fixture:
  local_ray            a fresh local Ray (2 CPUs, 256 MiB object store) for the module's tests; the ray module
Function fixture:
  miles_home           a fresh, empty $MILES_HOME for one test (built-ins are rebuilt there on use)
"""

from __future__ import annotations

import os

for _var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ.setdefault(_var, "1")

from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: end-to-end or model-building tests (seconds to minutes)")


@pytest.fixture(scope="session", autouse=True)
def miles_session_home(tmp_path_factory: pytest.TempPathFactory):
    # MILES_TEST_HOME: reuse one home's builds across sessions while iterating locally (CI leaves it unset,
    # so every session builds the tiny models from this checkout's code)
    reuse = os.environ.get("MILES_TEST_HOME")
    home = Path(reuse) if reuse else tmp_path_factory.mktemp("miles_home")
    patch = pytest.MonkeyPatch()
    patch.setenv("MILES_HOME", str(home))
    yield home
    patch.undo()


@pytest.fixture
def miles_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "miles_home"
    home.mkdir()
    monkeypatch.setenv("MILES_HOME", str(home))
    return home


@pytest.fixture(scope="module")
def local_ray():
    """A new local Ray for one test module (never a cluster someone started with `ray start`)."""
    import ray

    ray.init(
        address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=256 * 1024**2
    )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_sd3_dir(miles_session_home: Path) -> Path:
    from miles.builtin.checkpoints import ensure_checkpoint

    path = ensure_checkpoint("tiny-sd3", progress=False)
    assert path == miles_session_home / "models" / "tiny-sd3"
    return path


@pytest.fixture(scope="session")
def tiny_flux_dir(miles_session_home: Path) -> Path:
    from miles.builtin.checkpoints import ensure_checkpoint

    return ensure_checkpoint("tiny-flux", progress=False)


@pytest.fixture(scope="session")
def tiny_flux_kontext_dir(miles_session_home: Path) -> Path:
    """tiny-flux-kontext with a short VAE fit (40 steps): the edit jobs' tests need its layout (a
    FluxKontextPipeline with 16 text tokens), not its reconstructions; the full build is the recipes'."""
    from miles.builtin.tiny.flux_kontext import build_tiny_flux_kontext
    from miles.models.tiny.metadata import current_design

    path = miles_session_home / "test-builds" / f"tiny-flux-kontext-design{current_design('tiny-flux-kontext')}-vae40"
    if not (path / "model_index.json").is_file():
        build_tiny_flux_kontext(path, progress=False, vae_steps=40)
    return path


@pytest.fixture(scope="session")
def tiny_flux2_klein_dir(miles_session_home: Path) -> Path:
    """tiny-flux2-klein with a short VAE fit (10 steps): the engine and trainer tests need its layout (a base
    Flux2KleinPipeline over a 28-layer Qwen3), not its reconstructions; the full build is the recipes'."""
    from miles.builtin.tiny.flux2 import build_tiny_flux2_klein
    from miles.models.tiny.metadata import current_design

    path = miles_session_home / "test-builds" / f"tiny-flux2-klein-design{current_design('tiny-flux2-klein')}-vae10"
    if not (path / "model_index.json").is_file():
        build_tiny_flux2_klein(path, progress=False, vae_steps=10)
    return path


@pytest.fixture(scope="session")
def tiny_z_image_dir(miles_session_home: Path) -> Path:
    """tiny-z-image with a short VAE fit (10 steps): its layout (a ZImagePipeline over a 4-layer Qwen3), not its
    reconstructions; the full build is the recipes'."""
    from miles.builtin.tiny.z_image import build_tiny_z_image
    from miles.models.tiny.metadata import current_design

    path = miles_session_home / "test-builds" / f"tiny-z-image-design{current_design('tiny-z-image')}-vae10"
    if not (path / "model_index.json").is_file():
        build_tiny_z_image(path, progress=False, vae_steps=10)
    return path


@pytest.fixture(scope="session")
def tiny_qwen_image_dir(miles_session_home: Path) -> Path:
    from miles.builtin.checkpoints import ensure_checkpoint

    return ensure_checkpoint("tiny-qwen-image", progress=False)


@pytest.fixture(scope="session")
def tiny_wan2_2_dir(miles_session_home: Path) -> Path:
    """tiny-wan2_2 with a short VAE fit (40 steps, about a fifth of the build): the tests need its layout, not
    its reconstructions; the full build's reconstruction scores are an `extended` test."""
    from miles.builtin.tiny.wan2_2 import build_tiny_wan2_2
    from miles.models.tiny.metadata import current_design

    path = miles_session_home / "test-builds" / f"tiny-wan2_2-design{current_design('tiny-wan2_2')}-vae40"
    if not (path / "model_index.json").is_file():
        build_tiny_wan2_2(path, progress=False, vae_steps=40)
    return path


@pytest.fixture(scope="session")
def tiny_cosmos3_dir(miles_session_home: Path) -> Path:
    """tiny-cosmos3 with a short VAE fit (60 steps, a fifth of the build's): the tests need its layout, not its
    reconstructions."""
    from miles.builtin.tiny.cosmos3 import build_tiny_cosmos3
    from miles.models.tiny.metadata import current_design

    path = miles_session_home / "test-builds" / f"tiny-cosmos3-design{current_design('tiny-cosmos3')}-vae60"
    if not (path / "model_index.json").is_file():
        build_tiny_cosmos3(path, progress=False, vae_steps=60)
    return path


@pytest.fixture(scope="session")
def tiny_ltx2_dir(miles_session_home: Path) -> Path:
    """tiny-ltx2 with a 5-step VAE fit (the tests need its layout, not its reconstructions; a fit step of the
    LTX-2 video VAE at 9x64x64 takes ~2 s on 2 cores)."""
    from miles.builtin.tiny.ltx import build_tiny_ltx2
    from miles.models.tiny.metadata import current_design

    path = miles_session_home / "test-builds" / f"tiny-ltx2-design{current_design('tiny-ltx2')}-vae5"
    if not (path / "model_index.json").is_file():
        build_tiny_ltx2(path, progress=False, vae_steps=5)
    return path


@pytest.fixture(scope="session")
def tiny_sd3_pipeline(tiny_sd3_dir: Path):
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_sd3_dir)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="session")
def digit_classifier(tiny_sd3_dir: Path):
    from miles.rewards.scorers.digit import load_digit_classifier

    return load_digit_classifier(tiny_sd3_dir)


@pytest.fixture(scope="session")
def digits_split():
    from miles.data.digits import load_digits_split

    return load_digits_split()


@pytest.fixture(scope="session")
def tiny_clip(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A tiny random CLIPModel and a CLIPProcessor, saved offline (a PickScore stand-in); -> (model_dir,
    processor_dir)."""
    import torch
    from transformers import CLIPConfig, CLIPImageProcessorPil, CLIPModel, CLIPProcessor

    from miles.models.tiny.tokenizers import CLIP_BOS, CLIP_EOS, build_clip_tokenizer

    root = tmp_path_factory.mktemp("tiny_clip")
    tokenizer = build_clip_tokenizer()
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(root / "processor")
    eos = tokenizer.convert_tokens_to_ids(CLIP_EOS)
    config = CLIPConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "max_position_embeddings": 77,
            "bos_token_id": tokenizer.convert_tokens_to_ids(CLIP_BOS),
            "eos_token_id": eos,
            "pad_token_id": eos,
        },
        vision_config={
            "image_size": 32,
            "patch_size": 8,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
        },
        projection_dim=16,
    )
    torch.manual_seed(0)
    CLIPModel(config).save_pretrained(root / "model")
    return str(root / "model"), str(root / "processor")


@dataclass(frozen=True)
class RolloutRun:
    out: Path  # the run's --output-dir
    debug: Path  # where --save-debug-rollout-data wrote r{rollout_id}.pt
    flags: tuple[str, ...]  # the job flags after `rollout-only`: give them to jobs that must match the run


@pytest.fixture(scope="session")
def diffusers_rollouts(tiny_sd3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> RolloutRun:
    from miles_cli.main import main

    root = tmp_path_factory.mktemp("rollouts")
    flags = ("--recipe", "tiny-digits-grpo", "--hf-checkpoint", str(tiny_sd3_dir))
    flags += ("--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--rollout-microgroup-size", "4")
    flags += ("--global-batch-size", "8", "--micro-batch-size", "8", "--diffusion-num-steps", "6")
    flags += ("--diffusion-num-sde-steps", "3", "--diffusion-sde-window-range", "0,5", "--num-rollout", "2")
    run = RolloutRun(out=root / "diffusers", debug=root / "debug", flags=flags)
    argv = ["rollout-only", *flags, "--output-dir", str(run.out)]
    assert main([*argv, "--save-debug-rollout-data", str(run.debug / "r{rollout_id}.pt")]) == 0
    return run


@pytest.fixture(scope="session")
def small_digit_eval(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    import json

    path = tmp_path_factory.mktemp("eval") / "ten_digits.jsonl"
    rows = [{"input": f"a handwritten digit {d}", "metadata": {"label": d}} for d in range(10)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return ["--eval-prompt-data", "digits", str(path)]
