"""Periodic exports (`--export-interval`, `--export-merged`): a real `train rl` with LoRA on tiny-sd3 (the CLI in a
subprocess, a real local Ray), each export loaded in a fresh process with plain diffusers, and an export killed
half-way (a failure injected into the real writer) leaving the previous one the latest, intact. `miles export` on
the run's `--save` folder writes the same files as the periodic export of the same rollout, to the bit, and
re-exporting over an export killed half-way leaves the previous files until the new ones are whole."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

CLI = [sys.executable, "-c", "from miles_cli.main import entry; entry()"]
SMALL = ["--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--rollout-microgroup-size", "2"]
SMALL += ["--global-batch-size", "8", "--micro-batch-size", "8", "--diffusion-num-steps", "6"]
SMALL += ["--diffusion-num-sde-steps", "2", "--diffusion-sde-window-range", "0,6", "--skip-eval-before-train"]
LOAD = r"""
import json, sys
import torch
from diffusers import StableDiffusion3Pipeline

base, lora, merged = sys.argv[1:4]

def sample(pipe):
    out = pipe("a handwritten digit 3", num_inference_steps=4, guidance_scale=4.0, height=64, width=64,
               generator=torch.Generator().manual_seed(0), output_type="pt")
    return out.images[0]

with_lora = StableDiffusion3Pipeline.from_pretrained(base)
with_lora.load_lora_weights(lora)
plain = StableDiffusion3Pipeline.from_pretrained(base)
full = StableDiffusion3Pipeline.from_pretrained(merged)
a, b, c = sample(with_lora), sample(full), sample(plain)
print(json.dumps({"lora_vs_merged": float((a - b).abs().max()), "lora_vs_base": float((a - c).abs().max())}))
"""


@pytest.fixture(scope="module")
def run(tiny_sd3_dir: Path, tmp_path_factory: pytest.TempPathFactory, small_digit_eval: list[str]) -> Path:
    out = tmp_path_factory.mktemp("exports") / "run"
    argv = [*CLI, "train", "rl", "--recipe", "tiny-digits-grpo", "--hf-checkpoint", str(tiny_sd3_dir), *SMALL]
    argv += small_digit_eval  # evaluated after the last rollout: 10 prompts, not digits:test's 360
    argv += ["--num-rollout", "2", "--use-lora", "--lora-rank", "4", "--lora-alpha", "4", "--lr", "1e-2"]
    argv += ["--export-interval", "1", "--export-merged", "--output-dir", str(out), "--save", str(out / "ckpt")]
    argv += ["--save-interval", "1"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert f"miles: exported rollout 2 (lora and pipeline) to {out / 'exports' / 'rollout_000002'}" in done.stdout
    return out


def test_every_interval_writes_an_adapter_and_a_merged_pipeline(run: Path) -> None:
    exports = run / "exports"
    assert sorted(p.name for p in exports.iterdir()) == ["latest.txt", "rollout_000001", "rollout_000002"]
    assert (exports / "latest.txt").read_text().strip() == "rollout_000002"
    for name in ("rollout_000001", "rollout_000002"):
        assert (exports / name / "lora" / "pytorch_lora_weights.safetensors").is_file()
        assert (exports / name / "pipeline" / "model_index.json").exists()
    # the last periodic export is the job's final export, to the bit
    from safetensors.torch import load_file

    last = load_file(exports / "rollout_000002" / "pipeline" / "transformer" / "diffusion_pytorch_model.safetensors")
    final = load_file(run / "checkpoint" / "transformer" / "diffusion_pytorch_model.safetensors")
    assert last.keys() == final.keys() and all(last[k].equal(final[k]) for k in last)


def test_an_export_loads_with_plain_diffusers_in_a_fresh_process(run: Path, tiny_sd3_dir: Path) -> None:
    target = run / "exports" / "rollout_000002"
    argv = [sys.executable, "-c", LOAD, str(tiny_sd3_dir), str(target / "lora"), str(target / "pipeline")]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, env={**os.environ})
    assert done.returncode == 0, done.stderr[-3000:]
    diffs = json.loads(done.stdout.strip().splitlines()[-1])
    assert diffs["lora_vs_merged"] < 1e-5, diffs  # the adapter on the base = the merged pipeline
    assert diffs["lora_vs_base"] > 1e-4, diffs  # and training changed the samples (4e-4 measured)


def test_a_killed_export_leaves_the_previous_one_the_latest(
    run: Path, tiny_sd3_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from diffusers import StableDiffusion3Pipeline
    from safetensors.torch import load_file

    from miles.config.resolution import schema_args
    from miles.models.families import resolve_family
    from miles.training.export import export_lora

    exports = run / "exports"
    before = {p: p.read_bytes() for p in (exports / "rollout_000002").rglob("*") if p.is_file()}
    state = load_file(exports / "rollout_000002" / "lora" / "pytorch_lora_weights.safetensors")
    args = schema_args(hf_checkpoint=str(tiny_sd3_dir), use_lora=True, lora_rank=4, lora_alpha=4)
    real = StableDiffusion3Pipeline.save_lora_weights

    def dies_half_way(where, **kwargs):  # the file is written, then the process "dies"
        real(where, **kwargs)
        raise KeyboardInterrupt("killed during the export")

    monkeypatch.setattr(StableDiffusion3Pipeline, "save_lora_weights", staticmethod(dies_half_way))
    with pytest.raises(KeyboardInterrupt):
        export_lora(args, resolve_family(str(tiny_sd3_dir)), state, exports / "rollout_000003" / "lora")
    assert not (exports / "rollout_000003" / "lora").exists()
    assert not [p for p in (exports / "rollout_000003").iterdir() if p.name.startswith(".")]
    assert (exports / "latest.txt").read_text().strip() == "rollout_000002"
    assert before == {p: p.read_bytes() for p in (exports / "rollout_000002").rglob("*") if p.is_file()}


def _same_files(a: Path, b: Path) -> None:
    from safetensors.torch import load_file

    x, y = load_file(a), load_file(b)
    assert x.keys() == y.keys() and all(x[k].equal(y[k]) for k in x), (a, b)


def test_miles_export_of_the_checkpoint_is_the_periodic_export(run: Path, capsys: pytest.CaptureFixture) -> None:
    from miles_cli.main import main

    ckpt = run / "ckpt"
    assert (ckpt / "config.yaml").is_file()  # the job wrote its config beside its checkpoints
    assert main(["export", str(ckpt), "--merged"]) == 0
    said = capsys.readouterr().out
    assert f"with the config {ckpt / 'config.yaml'}" in said and "exported step 1 (live weights)" in said
    mine, theirs = ckpt / "exports" / "iter_0000001", run / "exports" / "rollout_000002"
    adapter = Path("lora") / "pytorch_lora_weights.safetensors"
    _same_files(mine / adapter, theirs / adapter)
    weights = Path("transformer") / "diffusion_pytorch_model.safetensors"
    _same_files(mine / "pipeline" / weights, theirs / "pipeline" / weights)
    # a step and a folder of one's own; without --merged, only the adapter
    assert main(["export", str(ckpt), "--ckpt-step", "0", "--out", str(run / "mine")]) == 0
    assert sorted(p.name for p in (run / "mine").iterdir()) == ["lora"]
    _same_files(
        run / "mine" / "lora" / "pytorch_lora_weights.safetensors",
        run / "exports" / "rollout_000001" / "lora" / "pytorch_lora_weights.safetensors",
    )


def test_miles_export_refuses_a_config_that_does_not_describe_the_checkpoint(
    run: Path, tiny_sd3_dir: Path, capsys: pytest.CaptureFixture
) -> None:
    from miles_cli.main import main

    # the recipe trains the full model: the checkpoint's LoRA tensors have no place in it
    argv = ["export", str(run / "ckpt"), "--config", "tiny-digits-grpo", "--hf-checkpoint", str(tiny_sd3_dir)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "have no place in the model the config describes" in err[0], err
    assert "--use-lora" in err[0]
    assert main(["export", str(run / "ckpt"), "--weights", "ema"]) == 2  # trained without --use-ema
    assert "has no ema.pt" in capsys.readouterr().err


def test_a_killed_re_export_keeps_the_previous_files(
    run: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from diffusers import StableDiffusion3Pipeline

    from miles_cli.main import main

    target = run / "again"
    assert main(["export", str(run / "ckpt"), "--out", str(target)]) == 0
    before = {p: p.read_bytes() for p in target.rglob("*") if p.is_file()}

    def dies_half_way(where, **kwargs):
        raise KeyboardInterrupt("killed during the export")

    monkeypatch.setattr(StableDiffusion3Pipeline, "save_lora_weights", staticmethod(dies_half_way))
    assert main(["export", str(run / "ckpt"), "--out", str(target)]) == 130  # `miles: interrupted`
    assert before == {p: p.read_bytes() for p in target.rglob("*") if p.is_file()}
    assert not [p for p in target.iterdir() if p.name.startswith(".")]
