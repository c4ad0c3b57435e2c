"""The preflight through the CLI: a job with a bad input exits 2 with the problem lines, before Ray starts; and
`inspect-config --check`."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from preflight_helpers import digit_prompts, write_lines

from miles_cli.main import main

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, _ANSI.sub("", out), _ANSI.sub("", err)


def test_a_broken_prompt_file_exits_2_before_ray_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray

    monkeypatch.setenv("COLUMNS", "200")
    bad = write_lines(tmp_path / "bad.jsonl", [*digit_prompts(2), "{oops"])
    argv = ["rollout-only", "--recipe", "tiny-digits-grpo", "--prompt-data", str(bad)]
    code, _, err = _run(capsys, *argv, "--output-dir", str(tmp_path / "out"))
    assert code == 2
    assert err.startswith(f"miles: error: --prompt-data {bad}:3: malformed JSON (")
    assert "Traceback" not in err
    assert not ray.is_initialized()
    assert not (tmp_path / "out").exists()  # nothing of the job was started or written


def test_several_problems_print_one_per_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    argv = ["train", "rl", "--recipe", "tiny-digits-grpo", "--hf-checkpoint", "./no-such-model"]
    argv += ["--diffusion-model-family", "sd3"]
    argv += ["--prompt-data", str(tmp_path / "nope.jsonl"), "--output-dir", str(tmp_path / "out")]
    code, _, err = _run(capsys, *argv)
    assert code == 2
    lines = err.rstrip("\n").splitlines()
    assert lines[0] == "miles: error: 2 problems:"
    assert lines[1].startswith(f"  - --hf-checkpoint {Path.cwd() / 'no-such-model'}: no such folder;")
    assert lines[2] == f"  - --prompt-data {tmp_path / 'nope.jsonl'}: prompt data file not found"


def test_inspect_config_check(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("COLUMNS", "200")
    code, out, _ = _run(capsys, "inspect-config", "--recipe", "tiny-digits-grpo", "--check")
    assert code == 0
    assert re.search(r"^miles: preflight passed \(13 checks, \d+\.\d\d s\)$", out, re.MULTILINE)
    code, _, err = _run(capsys, "inspect-config", "--recipe", "tiny-digits-grpo", "--load", str(tmp_path), "--check")
    assert code == 2
    assert err == (
        f"miles: error: --load {tmp_path}: no latest_checkpointed_iteration.txt (not a checkpoint directory, or no "
        "save finished); pass --ckpt-step to pick one (available steps: none)\n"
    )
