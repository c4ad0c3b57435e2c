"""The model-path checks: built-in names, local folders and the local Hugging Face cache, never the network."""

from __future__ import annotations

import json
from pathlib import Path

from preflight_helpers import Job, make_pipeline

from miles.preflight import find_problems
from miles.preflight.models import check_model_paths


def _cache_snapshot(cache: Path, repo_id: str, revision: str = "abc123") -> Path:
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    return repo / "snapshots" / revision


def test_a_missing_local_checkpoint_folder(job: Job) -> None:
    resolved = job("rl", hf_checkpoint="./no-such-model", diffusion_model_family="sd3")
    assert find_problems(resolved) == [
        f"--hf-checkpoint {Path.cwd() / 'no-such-model'}: no such folder; give a local diffusers pipeline folder, "
        "a Hugging Face id (org/name) in the local cache, or a built-in model (tiny-sd3, tiny-flux, ...)"
    ]


def test_a_hub_id_not_in_the_cache_names_the_cache_and_offline_mode(job: Job, hf_cache: Path) -> None:
    resolved = job("rl", hf_checkpoint="stabilityai/stable-diffusion-3.5-medium")
    assert check_model_paths(resolved) == [
        "--hf-checkpoint stabilityai/stable-diffusion-3.5-medium: neither a local folder nor in the Hugging Face "
        f"cache {hf_cache}, HF_HUB_OFFLINE=1; download it first (`huggingface-cli download "
        "stabilityai/stable-diffusion-3.5-medium`), or give a local folder or a built-in model (tiny-sd3, "
        "tiny-flux, ...)"
    ]


def test_a_hub_id_in_the_cache_passes(job: Job, hf_cache: Path) -> None:
    make_pipeline(_cache_snapshot(hf_cache, "stabilityai/stable-diffusion-3.5-medium"))
    assert check_model_paths(job("rl", hf_checkpoint="stabilityai/stable-diffusion-3.5-medium")) == []


def test_an_incomplete_cached_snapshot_is_named(job: Job, hf_cache: Path) -> None:
    snapshot = make_pipeline(_cache_snapshot(hf_cache, "stabilityai/stable-diffusion-3.5-medium"))
    (snapshot / "transformer" / "config.json").unlink()
    (line,) = check_model_paths(job("rl", hf_checkpoint="stabilityai/stable-diffusion-3.5-medium"))
    assert line == (
        f"--hf-checkpoint stabilityai/stable-diffusion-3.5-medium: the cached snapshot {snapshot} lacks "
        "transformer/config.json; copy or download the whole pipeline again (`huggingface-cli download "
        "stabilityai/stable-diffusion-3.5-medium` completes it)"
    )


def test_a_local_folder_without_model_index_or_a_component(job: Job, tmp_path: Path) -> None:
    empty = tmp_path / "my-sd3"
    empty.mkdir()
    assert check_model_paths(job("rl", hf_checkpoint=str(empty))) == [
        f"--hf-checkpoint {empty}: the folder holds no model_index.json; give a diffusers pipeline folder (the one "
        "with model_index.json)"
    ]
    pipe = make_pipeline(tmp_path / "sd3-copy")
    index = json.loads((pipe / "model_index.json").read_text())
    (pipe / "model_index.json").write_text(json.dumps({**index, "text_encoder": ["transformers", "CLIP"]}))
    assert check_model_paths(job("rl", hf_checkpoint=str(pipe))) == [
        f"--hf-checkpoint {pipe}: the folder lacks text_encoder; copy or download the whole pipeline again"
    ]


def test_a_complete_local_folder_and_a_builtin_name_pass(job: Job, tmp_path: Path) -> None:
    assert check_model_paths(job("rl", hf_checkpoint=str(make_pipeline(tmp_path / "sd3-copy")))) == []
    assert check_model_paths(job("rl")) == []  # tiny-sd3-digits-sft-short: built on first use


def test_the_teacher_and_the_student_share_one_line(job: Job) -> None:
    resolved = job("dmd2", recipe="tiny-digits-4step", hf_checkpoint="org/sd3-missing")
    (line,) = check_model_paths(resolved)
    assert line.startswith("--hf-checkpoint (and --teacher-checkpoint) org/sd3-missing: neither a local folder")


def test_the_pickscore_paths(job: Job, tmp_path: Path) -> None:
    model, processor = tmp_path / "pickscore", tmp_path / "processor"
    model.mkdir()
    processor.mkdir()
    (processor / "preprocessor_config.json").write_text("{}")
    resolved = job("rl", rm_type="pickscore", pickscore_model_path=str(model), pickscore_processor_path=str(processor))
    assert check_model_paths(resolved) == [
        f"--pickscore-model-path {model}: the folder holds no config.json (not a transformers model folder)"
    ]
