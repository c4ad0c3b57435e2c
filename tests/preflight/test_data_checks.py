"""The data checks: every prompt-data problem is one exact line naming the flag, the file and the line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from preflight_helpers import Job, digit_prompts, write_lines

from miles.data.prompt_file import MAX_LINE_BYTES, PromptKeys, iter_jsonl_objects
from miles.data.prompts import load_prompts
from miles.preflight import find_problems


def test_broken_json_on_line_3(job: Job, tmp_path: Path) -> None:
    bad = write_lines(tmp_path / "bad.jsonl", [*digit_prompts(2), '{"input": "c", oops}'])
    assert find_problems(job("rl", prompt_data=str(bad))) == [
        f"--prompt-data {bad}:3: malformed JSON (Expecting property name enclosed in double quotes at column 16); "
        "fix or remove that line"
    ]


def test_the_preflight_line_is_the_runtime_line_with_the_flag(job: Job, tmp_path: Path) -> None:
    from miles.core.errors import ConfigError

    bad = write_lines(tmp_path / "bad.jsonl", [*digit_prompts(2), "{oops"])
    with pytest.raises(ConfigError) as info:
        load_prompts(bad)
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
        f"--prompt-data {folder}: is a directory, not a prompt data file (name the file inside it) nor a folder "
        "Dataset.save_to_disk wrote (it has no state.json)"
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


def test_a_lone_surrogate_is_refused_with_its_line_in_every_file_kind(job: Job, tmp_path: Path) -> None:
    """JSON's \\udc80 escape decodes to a string no later write can encode (logs, metrics, the tokenizer): the
    shared reader refuses it with file:line for prompt data, SFT rows and preference data alike."""
    from miles.core.errors import ConfigError
    from miles.data.prompt_file import iter_jsonl_objects

    path = tmp_path / "p.jsonl"
    path.write_text('{"input": "ok", "metadata": {"label": 1}}\n{"input": "bad \\udc80 text"}\n')
    assert find_problems(job("rl", prompt_data=str(path))) == [
        f"--prompt-data {path}:2: text that cannot be written as UTF-8 (a lone surrogate, \\udc80, at character 5 "
        "of key 'input'); fix or remove that line"
    ]
    nested = tmp_path / "rows.jsonl"
    nested.write_text('{"input": "ok", "metadata": {"tags": ["fine", "x\\ud800"]}}\n')
    for what in ("SFT data", "preference data"):
        with pytest.raises(
            ConfigError, match=r"rows\.jsonl:1: .*\\ud800, at character 2 of key 'metadata\.tags\[1\]'"
        ):
            list(iter_jsonl_objects(nested, what))


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
    assert [r.prompt[:1] for r in load_prompts(handle.name)] == ["y", "z"]
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
    from miles.rewards import REWARD_TYPES

    path = write_lines(tmp_path / "p.jsonl", [{"input": "a", "metadata": {"rm_type": "hpsv3", "label": 1}}])
    assert find_problems(job("rl", prompt_data=str(path))) == [
        f"--prompt-data {path}:1: metadata.rm_type 'hpsv3' is not a reward type ({', '.join(REWARD_TYPES)}); use "
        "one of them or --custom-rm-path; fix or remove that line"
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
    # without --eval-interval the job still evaluates them, after its last rollout: they are read, so checked
    assert find_problems(job("rl", eval_prompt_data=["held", str(bad)])) == find_problems(resolved)


def _png(path: Path) -> Path:
    from PIL import Image

    Image.new("RGB", (8, 8)).save(path)
    return path


def test_sft_rows_need_their_image_files(job: Job, tmp_path: Path) -> None:
    _png(tmp_path / "a.png")
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
    scan_prompt_file(path, PromptKeys(), [])
    assert time.perf_counter() - start < 3.0  # 200k lines here; the bench runs the million


# ---- the digit label, numbers JSON parses but Python cannot hold, what is not a regular file ---------------------
@pytest.mark.parametrize(
    ("label", "shown"),
    [("3.7", "3.7"), ("3.0", "3.0"), ("true", "true"), ('"3"', '"3"'), ("Infinity", "Infinity"), ("NaN", "NaN")],
)
def test_the_digit_label_must_be_an_integer(job: Job, tmp_path: Path, label: str, shown: str) -> None:
    path = write_lines(
        tmp_path / "p.jsonl", [*digit_prompts(1), f'{{"input": "x", "metadata": {{"label": {label}}}}}']
    )
    assert find_problems(job("rl", prompt_data=str(path))) == [
        f"--prompt-data {path}:2: metadata.label must be an integer 0-9, got {shown}; fix or remove that line"
    ]


def test_a_label_out_of_range(job: Job, tmp_path: Path) -> None:
    path = write_lines(tmp_path / "p.jsonl", [{"input": "x", "metadata": {"label": 10}}])
    assert find_problems(job("rl", prompt_data=str(path))) == [
        f"--prompt-data {path}:1: metadata.label must be a digit 0-9, got 10; fix or remove that line"
    ]


def test_a_number_past_pythons_digit_limit(job: Job, tmp_path: Path) -> None:
    import sys

    digits = "9" * (sys.get_int_max_str_digits() + 700)
    path = write_lines(tmp_path / "p.jsonl", [f'{{"input": "x", "metadata": {{"label": {digits}}}}}'])
    assert find_problems(job("rl", prompt_data=str(path))) == [
        f"--prompt-data {path}:1: a number of more than {sys.get_int_max_str_digits():,} digits (Python's limit for "
        "reading an integer); fix or remove that line"
    ]


def test_a_fifo_and_a_device_are_not_regular_files(job: Job, tmp_path: Path) -> None:
    import os

    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    for path in (fifo, Path("/dev/zero")):
        assert find_problems(job("rl", prompt_data=str(path))) == [
            f"--prompt-data {path}: is not a regular file (a device, FIFO or socket); give a prompt data file"
        ]


@pytest.mark.parametrize("url", ["https://example.com/x.jsonl", "hf://datasets/foo/bar"])
def test_a_url_is_quoted_as_given_and_not_read(job: Job, url: str) -> None:
    message = f"{url}: is a URL, and miles does not read URLs; download it and give a local prompt data file"
    assert find_problems(job("rl", prompt_data=url)) == [f"--prompt-data {message}"]
    assert find_problems(job("rl", eval_prompt_data=["held", url], eval_interval="5")) == [
        f"--eval-prompt-data held {message}"
    ]


def test_a_path_ending_in_digits_is_no_line_of_a_file(
    job: Job, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert find_problems(job("rl", eval_prompt_data=["d", "5"], eval_interval="5")) == [
        f"--eval-prompt-data d {tmp_path / '5'}: prompt data file not found"
    ]
    (tmp_path / "7").write_text("")
    empty = f"--prompt-data {tmp_path / '7'}: no prompts (the file is empty)"
    assert find_problems(job("rl", prompt_data="7")) == [empty]


# ---- SFT rows -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("caption", "why"), [(5, "must be a string, got a number"), ("  ", "is empty")])
def test_an_sft_caption_must_be_a_non_empty_string(job: Job, tmp_path: Path, caption: object, why: str) -> None:
    _png(tmp_path / "a.png")
    path = write_lines(
        tmp_path / "sft.jsonl", [{"image": "a.png", "input": "a"}, {"image": "a.png", "input": caption}]
    )
    assert find_problems(job("sft", recipe="tiny-digits-sft", prompt_data=str(path))) == [
        f"--prompt-data {path}:2: 'input' {why}; fix or remove that line"
    ]


def test_an_sft_image_that_does_not_decode(job: Job, tmp_path: Path) -> None:
    _png(tmp_path / "a.png")
    (tmp_path / "b.png").write_bytes(b"not a png at all")
    whole = (tmp_path / "a.png").read_bytes()
    (tmp_path / "c.png").write_bytes(whole[: len(whole) - 20])  # cut before its end
    rows = [{"image": name, "input": "x"} for name in ("a.png", "b.png")]
    path = write_lines(tmp_path / "sft.jsonl", rows)
    assert find_problems(job("sft", recipe="tiny-digits-sft", prompt_data=str(path))) == [
        f"--prompt-data {path}:2: SFT image {tmp_path / 'b.png'} does not decode (not an image PIL knows); "
        "fix or remove that line"
    ]
    path = write_lines(tmp_path / "sft2.jsonl", [{"image": "c.png", "input": "x"}])
    (line,) = find_problems(job("sft", recipe="tiny-digits-sft", prompt_data=str(path)))
    assert line.startswith(f"--prompt-data {path}:1: SFT image {tmp_path / 'c.png'} does not decode (")


def test_the_sft_reader_refuses_what_the_preflight_refuses(tmp_path: Path) -> None:
    from miles.core.errors import ConfigError
    from miles.training.sft_data import _load_image, read_rows

    path = write_lines(tmp_path / "sft.jsonl", [{"image": "a.png", "input": 5}])
    with pytest.raises(ConfigError, match=rf"^{path}:1: 'input' must be a string, got a number$"):
        read_rows(path, "input")
    (tmp_path / "b.png").write_bytes(b"garbage")
    with pytest.raises(ConfigError, match=r"^SFT image .*b\.png does not decode \("):
        _load_image(tmp_path / "b.png", (8, 8))


# ---- --eval-config ------------------------------------------------------------------------------------------------
def _eval_config(tmp_path: Path, text: str) -> Path:
    write_lines(tmp_path / "e.jsonl", digit_prompts(2))
    config = tmp_path / "eval.yaml"
    config.write_text(text.replace("E", str(tmp_path / "e.jsonl")))
    return config


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (
            "datasets:\n  - name: a\n    path: E\n  - name: a\n    path: E\n",
            ":4: key 'datasets[1].name': the name 'a' is given twice (first at line 2)",
        ),
        (
            "datasets:\n  - name: a\n    path: E\n    n_sample_per_eval_prompt: 4\n",
            ":4: key 'datasets[0].n_sample_per_eval_prompt': unknown key (did you mean 'n_samples_per_eval_prompt'?)",
        ),
        (
            "datasets:\n  - name: a\n    path: E\n    colour: red\n",
            ":4: key 'datasets[0].colour': unknown key; known keys: 'name', 'path', 'n_samples_per_eval_prompt', "
            "'num_steps'",
        ),
        (
            "datasets:\n  - name: a\n    path: E\ndataset: 1\n",
            ":4: key 'dataset': unknown key (did you mean 'datasets'?)",
        ),
        (
            "datasets:\n  - name: a\n    path:\n",
            ":3: key 'datasets[0].path': path is null; give the dataset's prompt JSONL file (or a built-in data set)",
        ),
        (
            "datasets:\n  - name: a\n    path: [E]\n",
            ":3: key 'datasets[0].path': path must be a string, got a list",
        ),
    ],
)
def test_eval_config_mistakes_name_the_file_line_and_key(job: Job, tmp_path: Path, text: str, problem: str) -> None:
    config = _eval_config(tmp_path, text)
    assert find_problems(job("rl", eval_config=str(config), eval_interval="5")) == [f"--eval-config {config}{problem}"]


def test_a_good_eval_config_passes(job: Job, tmp_path: Path) -> None:
    config = _eval_config(tmp_path, "datasets:\n  - {name: a, path: E, num_steps: 2}\n  - {name: b, path: E}\n")
    assert find_problems(job("rl", eval_config=str(config), eval_interval="5")) == []


# ---- a check that crashes ------------------------------------------------------------------------------------------
def test_a_crashing_check_is_a_warning_not_a_verdict(job: Job, capsys: pytest.CaptureFixture[str]) -> None:
    from miles.preflight import Check, run_checks

    def broken(resolved: object) -> list[str]:
        raise KeyError("oops")

    report = run_checks(job("rl"), (Check("broken", broken),))
    line = "preflight check 'broken' could not run (KeyError: 'oops'), so what it checks was not checked; please "
    line += "report this as a bug"
    assert (report.problems, report.failed, report.checks) == ([], [line], 1)
    assert capsys.readouterr().err == f"miles: warning: {line}\n"
