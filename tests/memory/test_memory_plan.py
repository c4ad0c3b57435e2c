"""`miles plan`'s memory plan on the shipped GPU recipes: per-GPU estimates from the shipped counts and traces (no
torch, under 2 s), a plan over the GPU memory refused in one line with the changes that fit (each computed), the
capacity's sources, the JSON breakdown, `inspect-config` printing it, and the GPU view of `--rollout-backend auto`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from miles.config.resolve import resolve
from miles_cli.main import main

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _no_capacity_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MILES_GPU_MEMORY_GIB", raising=False)


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def _peak(out: str) -> float:
    return float(re.search(r"memory: peak ([\d.]+) GiB per GPU", out).group(1))  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "recipe",
    [
        "sd35-4step",
        "sd3-ocr-grpo",
        "qwen-image-pickscore-grpo",
        "qwen-image-edit-grpo",  # the same tiles at 512 px, with a ~1 MP source after the generated tokens
        "wan22-pickscore-grpo",  # fits on 80 GiB since the trainer's frozen base leaves before the LoRA-only sync
        "wan22-i2v-grpo",  # the same layout on the I2V experts, on the in-process engines
    ],
)
def test_plan_prints_per_gpu_estimates_of_the_shipped_recipes(capsys, recipe: str) -> None:
    rc, out, err = _cli(capsys, "plan", "--recipe", recipe)
    assert "train GiB" in out and "sync GiB" in out and "rollout GiB" in out
    assert "memory: traced actor step" in out  # the activations come from a trace, and say which
    peak = _peak(out)
    assert 10 < peak < 80
    assert rc == 0 and "fits" in out, err


def test_a_plan_over_the_gpu_memory_is_refused_with_the_knobs_that_fit(capsys) -> None:
    rc, out, err = _cli(capsys, "plan", "--recipe", "sd35-4step", "--gpu-memory-gib", "20.5")
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    line = lines[0]
    assert line.startswith("miles: error: the memory plan does not fit: node 0 GPU 0 peaks at ")
    assert f"{_peak(out):.1f} GiB" in line and "over the 20.5 GiB per GPU of --gpu-memory-gib" in line
    assert "; fits with: " in line
    changes = re.findall(r"(--[a-z-]+(?: \d+)?) -> ([\d.]+) GiB", line)
    assert len(changes) >= 2, line
    for flags, gib in changes:
        assert float(gib) <= 20.5, (flags, gib)  # each change was computed and fits
    # each number is the plan of the job with that change
    for flags, gib in changes:
        name, _, value = flags.partition(" ")
        more = [name, *([value] if value else [])]
        rc2, out2, _ = _cli(capsys, "plan", "--recipe", "sd35-4step", "--gpu-memory-gib", "20.5", *more)
        assert rc2 == 0 and _peak(out2) == pytest.approx(float(gib), abs=0.05)


def test_when_no_change_fits_the_refusal_says_how_far_each_one_gets(capsys) -> None:
    """The rollout phase's pipeline (15.3 GiB) bounds sd35-4step: at 18.5 GiB no change is enough, and the line says
    what each one computes to (each under the peak it starts from)."""
    rc, out, err = _cli(capsys, "plan", "--recipe", "sd35-4step", "--gpu-memory-gib", "18.5")
    assert rc == 2
    line = err.strip()
    assert "; still over with: " in line
    changes = re.findall(r"(--[a-z-]+(?: \d+)?) -> ([\d.]+) GiB", line)
    assert changes and all(18.5 < float(gib) < _peak(out) for _, gib in changes), line


def test_gpu_memory_zero_turns_the_check_off(capsys) -> None:
    rc, out, _ = _cli(capsys, "plan", "--recipe", "wan22-pickscore-grpo", "--gpu-memory-gib", "0")
    assert rc == 0 and "no check (--gpu-memory-gib 0)" in out


def test_capacity_comes_from_the_env_and_from_a_fake_nvidia_smi(capsys, monkeypatch, tmp_path: Path) -> None:
    """A fake nvidia-smi (this machine has no GPU): the plan reads the smallest GPU's memory from it."""
    monkeypatch.setenv("MILES_GPU_MEMORY_GIB", "200")
    rc, out, _ = _cli(capsys, "plan", "--recipe", "wan22-pickscore-grpo")
    assert rc == 0 and "of 200 GiB ($MILES_GPU_MEMORY_GIB)" in out
    monkeypatch.delenv("MILES_GPU_MEMORY_GIB")
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 143771\necho 81559\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    from miles.memory.estimate import capacity

    args = resolve(None, recipe="sd3-ocr-grpo").args
    gib, source = capacity(args)
    assert source == "nvidia-smi" and gib == pytest.approx(81559 / 1024, abs=0.01)


def test_plan_json_carries_the_memory_breakdown(capsys) -> None:
    rc, out, _ = _cli(capsys, "plan", "--recipe", "sd3-ocr-grpo", "--format", "json")
    assert rc == 0
    rows = json.loads(out)
    actor = next(r for r in rows if r["role"] == "actor" and r["index"] == 0)
    train = {e["name"]: e for e in actor["memory"]["train"]["entries"]}
    assert {"params", "grads", "adam", "activations"} <= set(train)
    assert train["activations"]["note"].startswith("traced: ")
    assert actor["memory"]["train"]["gib"] == pytest.approx(sum(e["gib"] for e in train.values()), abs=0.01)
    rollout = {e["name"] for e in actor["memory"]["rollout"]["entries"]}
    assert {"pipeline", "denoise activations"} <= rollout


def test_inspect_config_prints_the_memory_plan_under_the_plan(capsys) -> None:
    rc, out, _ = _cli(capsys, "inspect-config", "--recipe", "sd3-ocr-grpo")
    assert rc == 0
    assert out.index("holds (share)") < out.index("memory: peak")


def test_the_gpu_view_counts_sglang_engines_on_a_machine_without_gpus() -> None:
    """Here `--rollout-backend auto` resolves to diffusers; the plan estimates what a GPU cluster runs (sglang), so
    neither the in-process engine's LoRA merge nor its base copies (host memory) are named for it."""
    from miles.memory.estimate import estimate_memory

    resolved = resolve(None, recipe="sd3-ocr-grpo")
    assert resolved.args.rollout_backend == "diffusers"
    estimate = estimate_memory(resolved)
    assert any("sglang" in n for n in estimate.notes)
    names = {e.name for g in estimate.gpus for es in g.phases.values() for e in es}
    assert "lora_merger/merge" not in names and "pipeline" in names
    assert not any("lora_merger/base_copies" in n for n in estimate.notes)
    explicit = estimate_memory(resolve(None, recipe="sd3-ocr-grpo", cli={"rollout_backend": "diffusers"}))
    names = {e.name for g in explicit.gpus for es in g.phases.values() for e in es}
    # asked for by name: the diffusers engine merges one module at a time on the GPU, its base copies on the host
    assert "lora_merger/merge" in names and "lora_merger/base_copies" not in names
    assert any(n.startswith("lora_merger/base_copies") and "host memory" in n for n in explicit.notes)


def test_shipped_traces_cover_every_step_the_shipped_plans_ask_for(monkeypatch) -> None:
    """`python -m miles.memory.shipped` is current: no shipped recipe's plan, nor a change its refusal computes,
    traces anything (a trace would take tens of seconds in `miles plan`)."""
    import miles.memory.activations as activations
    from miles.memory.shipped import shipped_trace_specs

    def refuse(config_dir, family, spec):
        raise AssertionError(f"not in {config_dir}/traces.json: {spec} (run python -m miles.memory.shipped)")

    monkeypatch.setattr(activations, "trace_step", refuse)
    specs = shipped_trace_specs()
    assert sum(len(s) for _, s in specs.values()) >= 10


def test_the_plan_of_a_shipped_recipe_imports_no_torch_and_takes_under_two_seconds(tmp_path: Path) -> None:
    code = (
        "import sys, time\n"
        "start = time.perf_counter()\n"
        "from miles_cli.main import main\n"
        "rc = main(['plan', '--recipe', 'qwen-image-pickscore-grpo'])\n"
        "print('SECONDS', time.perf_counter() - start)\n"
        "print('HEAVY', [m for m in ('torch', 'diffusers', 'transformers', 'ray') if m in sys.modules])\n"
        "print('RC', rc)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MILES_HOME": str(tmp_path)}
    env.pop("MILES_GPU_MEMORY_GIB", None)
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr
    lines = dict(
        line.split(" ", 1) for line in out.stdout.splitlines() if line.split(" ", 1)[0] in ("SECONDS", "HEAVY", "RC")
    )
    assert lines["HEAVY"] == "[]" and lines["RC"] == "0"
    assert float(lines["SECONDS"]) < 2.0, lines
    assert time.perf_counter() - start < 10
