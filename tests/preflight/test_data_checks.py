"""The data checks: every prompt-data problem is one exact line naming the flag, the file and the line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import Job
from preflight_helpers import digit_prompts, write_lines

from miles.preflight import find_problems
from miles.rollout.prompt_file import MAX_LINE_BYTES, iter_jsonl_objects, load_prompt_jsonl


def test_broken_json_on_line_3(job: Job, tmp_path: Path) -> None:
    bad = write_lines(tmp_path / "bad.jsonl", [*digit_prompts(2), '{"input": "c", oops}'])
    assert find_problems(job("rl", prompt_data=str(bad))) == [
        f"--prompt-data {bad}:3: malformed JSON (Expecting property name enclosed in double quotes at column 16); "
        "fix or remove that line"
    ]


def test_the_preflight_line_is_the_runtime_line_with_the_flag(job: Job, tmp_path: Path) -> None:
    from miles.config.errors import ConfigError

    bad = write_lines(tmp_path / "bad.jsonl", [*digit_prompts(2), "{oops"])
    with pytest.raises(ConfigError) as info:
        load_prompt_jsonl(bad)
    (line,) = find_problems(job("rollout-only", prompt_data=str(bad)))
    assert line.startswith(f"--prompt-data {info.value}")


def test_missing_file(job: Job, tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    assert find_problems(job("rl", prompt_data=str(missing))) == [
        f"--prompt-data {missing}: prompt data file not found"
    ]


def test_a_directory(job: Job, tmp_path: Path) -> None:
    folder = tmp_path / "data"
    folder.mkdir()
    assert find_problems(job("rl", prompt_data=str(folder))) == [
        f"--prompt-data {folder}: is a directory, not a prompt data file (name the .jsonl file inside it)"
    ]


def test_empty_file(job: Job, tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    assert find_problems(job("rl", prompt_data=str(empty))) == [
        f"--prompt-data {empty}: no prompts (the file is empty)"
    ]


def test_wrong_key(job: Job, tmp_path: Path) -> None:
    path = write_lines(tmp_path / "p.jsonl", [{"prompt": "a", "metadata": {"label": 1}}])
    assert find_problems(job("rl", prompt_data=str(path))) == [
        f"--prompt-data {path}:1: missing key 'input' (--input-key); keys: 'metadata', 'prompt'; "
        "fix or remove that line"
    ]


def test_non_string_prompt(job: Job, tmp_path: Path) -> None:
    path = write_lines(tmp_path / "p.jsonl", [*digit_prompts(1), {"input": 7, "metadata": {"label": 7}}])
    assert find_problems(job("rl", prompt_data=str(path))) == [
        f"--prompt-data {path}:2: 'input' must be a string, got a number; fix or remove that line"
    ]


def test_metadata_must_be_an_object(job: Job, tmp_path: Path) -> None:
    path = write_lines(tmp_path / "p.jsonl", [{"input": "x", "metadata": [1]}])
    assert find_problems(job("rl", prompt_data=str(path))) == [
        f"--prompt-data {path}:1: 'metadata' (--metadata-key) must be a dict, got a list; fix or remove that line"
    ]


def test_invalid_utf8(job: Job, tmp_path: Path) -> None:
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"input": "ok", "metadata": {"label": 1}}\n{"input": "caf\xe9"}\n')
    assert find_problems(job("rl", prompt_data=str(path))) == [
        f"--prompt-data {path}:2: not UTF-8 text (invalid continuation byte at byte 15); fix or remove that line"
    ]


def test_huge_line_is_refused_in_a_short_message(job: Job, tmp_path: Path) -> None:
    path = tmp_path / "huge.jsonl"
    with path.open("w") as handle:
        handle.write(json.dumps({"input": "x" * (MAX_LINE_BYTES + 10), "metadata": {"label": 1}}) + "\n")
    (line,) = find_problems(job("rl", prompt_data=str(path)))
    assert line.startswith(f"--prompt-data {path}:1: line longer than 1 MiB (MAX_LINE_BYTES")
    assert len(line) < 300
    assert "xxxxxxxx" not in line


def test_a_line_of_exactly_the_limit_is_read() -> None:
    import tempfile

    row = {"input": "", "metadata": {}}
    pad = MAX_LINE_BYTES - len(json.dumps(row))
    row["input"] = "y" * pad
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as handle:
        handle.write(json.dumps(row) + "\n" + json.dumps({"input": "z"}) + "\n")
    assert [r.prompt[:1] for r in load_prompt_jsonl(handle.name)] == ["y", "z"]
    Path(handle.name).unlink()


def test_the_reader_streams_the_file(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "p.jsonl", [*digit_prompts(3), "{oops"])
    rows = iter_jsonl_objects(path)
    assert next(rows)[0] == f"{path}:1"  # the first line, before the broken one is read


def test_the_digit_reward_needs_a_label(job: Job, tmp_path: Path) -> None:
    path = write_lines(tmp_path / "p.jsonl", [*digit_prompts(1), {"input": "a three", "metadata": {"tag": "x"}}])
    assert find_problems(job("rl", prompt_data=str(path))) == [
        f"--prompt-data {path}:2: the digit reward needs metadata.label (the digit to draw); metadata has 'tag'; "
        "fix or remove that line"
    ]


def test_the_ocr_reward_needs_a_quoted_target_and_the_prompt_is_clipped(job: Job, tmp_path: Path) -> None:
    long_prompt = "no quotes here " * 40
    path = write_lines(tmp_path / "p.jsonl", [{"input": 'say "hi"'}, {"input": long_prompt}])
    (line,) = find_problems(job("rl", prompt_data=str(path), rm_type="ocr"))
    assert line.startswith(f"--prompt-data {path}:2: the OCR reward needs the target text in double quotes")
    assert f"({len(long_prompt):,} chars)" in line and len(line) < 300


def test_an_unknown_metadata_reward_type(job: Job, tmp_path: Path) -> None:
    path = write_lines(tmp_path / "p.jsonl", [{"input": "a", "metadata": {"rm_type": "aesthetic", "label": 1}}])
    assert find_problems(job("rl", prompt_data=str(path))) == [
        f"--prompt-data {path}:1: metadata.rm_type 'aesthetic' is not a built-in reward (digit, ocr, pickscore, "
        "jpeg_compressibility, jpeg_incompressibility); use one of them or --custom-rm-path; fix or remove that line"
    ]


def test_a_good_file_and_the_builtin_sets_pass(job: Job, tmp_path: Path) -> None:
    path = write_lines(tmp_path / "p.jsonl", digit_prompts(30))
    assert find_problems(job("rl", prompt_data=str(path))) == []
    assert find_problems(job("rl")) == []  # digits:labels and digits:test, generated on first use


def test_eval_sets_are_checked_when_the_job_evaluates(job: Job, tmp_path: Path) -> None:
    bad = write_lines(tmp_path / "eval.jsonl", ["[1]"])
    resolved = job("rl", eval_prompt_data=["held", str(bad)], eval_interval="5")
    assert find_problems(resolved) == [
        f"--eval-prompt-data held {bad}:1: expected a JSON object, got a list; fix or remove that line"
    ]
    assert find_problems(job("rl", eval_prompt_data=["held", str(bad)])) == []  # rl without --eval-interval


def test_sft_rows_need_their_image_files(job: Job, tmp_path: Path) -> None:
    (tmp_path / "a.png").write_bytes(b"png")
    path = write_lines(tmp_path / "sft.jsonl", [{"image": "a.png", "input": "a"}, {"image": "b.png", "input": "b"}])
    assert find_problems(job("sft", recipe="tiny-digits-sft", prompt_data=str(path))) == [
        f"--prompt-data {path}:2: SFT image not found: {tmp_path / 'b.png'}; fix or remove that line"
    ]


def test_a_million_lines_stream_in_seconds(tmp_path: Path) -> None:
    import time

    from miles.preflight.data import scan_prompt_file

    path = tmp_path / "big.jsonl"
    line = json.dumps({"input": "the digit 3", "metadata": {"label": 3}}) + "\n"
    path.write_text(line * 200_000)
    start = time.perf_counter()
    scan_prompt_file(path, "input", "metadata", [])
    assert time.perf_counter() - start < 3.0  # 200k lines here; the bench runs the million
