"""The preflight of offline DPO's preference rows (`train sft --loss-type dpo`): every bad row is one line naming
the flag, the file, the line and the key; the reader stops at the same line with the same words."""

from __future__ import annotations

from pathlib import Path

import pytest
from preflight_helpers import Job, write_lines

from miles.preflight import find_problems

RECIPE = "tiny-digits-dpo-offline"


def _images(folder: Path, *names: str) -> None:
    from PIL import Image

    for name in names:
        Image.new("RGB", (8, 8), (255, 255, 255)).save(folder / name)


def _row(caption: object = "a handwritten digit 3", chosen: object = "a.png", rejected: object = "b.png") -> dict:
    return {"input": caption, "chosen": chosen, "rejected": rejected, "metadata": {"label": 3}}


def test_good_rows_pass_and_the_built_in_set_is_not_scanned(job: Job, tmp_path: Path) -> None:
    _images(tmp_path, "a.png", "b.png")
    path = write_lines(tmp_path / "prefs.jsonl", [_row(), _row(chosen="b.png", rejected="a.png")])
    assert find_problems(job("sft", recipe=RECIPE, prompt_data=str(path))) == []
    assert find_problems(job("sft", recipe=RECIPE)) == []  # digits-preference:train, made on first use


@pytest.mark.slow  # sklearn's digits: ~1 s to import
def test_the_digit_preference_set_passes_the_check(job: Job, tmp_path: Path) -> None:
    from miles.data.digit_preferences import write_digit_preference_data

    files = write_digit_preference_data(tmp_path / "prefs", limit=12)
    assert find_problems(job("sft", recipe=RECIPE, prompt_data=str(files["train"]))) == []


@pytest.mark.parametrize(
    ("row", "why"),
    [
        (
            {"input": "x", "rejected": "b.png"},
            "missing key 'chosen' (--chosen-key) of a preference row; keys: 'input', 'rejected'",
        ),
        (_row(rejected=None) | {"rejected": None}, "'rejected' (--rejected-key) must be an image file path, got null"),
        (_row(chosen=7), "'chosen' (--chosen-key) must be an image file path, got a number"),
        (_row(chosen=""), "'chosen' (--chosen-key) must be an image file path, got an empty string"),
        (_row(caption=""), "'input' is empty"),
        (_row(rejected="a.png"), "'chosen' and 'rejected' name the same image 'a.png'; a preference pair needs two"),
        (_row() | {"metadata": [3]}, "'metadata' (--metadata-key) must be a dict, got a list"),
    ],
)
def test_a_bad_row_is_one_line_naming_file_line_and_key(job: Job, tmp_path: Path, row: dict, why: str) -> None:
    _images(tmp_path, "a.png", "b.png")
    path = write_lines(tmp_path / "prefs.jsonl", [_row(), row])
    (line,) = find_problems(job("sft", recipe=RECIPE, prompt_data=str(path)))
    assert line.startswith(f"--prompt-data {path}:2: {why}") and line.endswith("; fix or remove that line")


def test_a_missing_or_broken_image(job: Job, tmp_path: Path) -> None:
    _images(tmp_path, "a.png")
    path = write_lines(tmp_path / "prefs.jsonl", [_row()])
    assert find_problems(job("sft", recipe=RECIPE, prompt_data=str(path))) == [
        f"--prompt-data {path}:1: 'rejected' (--rejected-key) image not found: {tmp_path / 'b.png'}; "
        "fix or remove that line"
    ]
    (tmp_path / "b.png").write_bytes(b"not a png")
    (line,) = find_problems(job("sft", recipe=RECIPE, prompt_data=str(path)))
    assert line.startswith(f"--prompt-data {path}:1: SFT image {tmp_path / 'b.png'} does not decode")


def test_the_keys_follow_their_flags(job: Job, tmp_path: Path) -> None:
    _images(tmp_path, "a.png", "b.png")
    path = write_lines(tmp_path / "prefs.jsonl", [{"caption": "x", "good": "a.png", "bad": "b.png"}])
    flags = {"prompt_data": str(path), "input_key": "caption", "chosen_key": "good", "rejected_key": "bad"}
    assert find_problems(job("sft", recipe=RECIPE, **flags)) == []
    (line,) = find_problems(job("sft", recipe=RECIPE, **(flags | {"rejected_key": "worse"})))
    assert line.startswith(f"--prompt-data {path}:1: missing key 'worse' (--rejected-key)")


def test_an_empty_file(job: Job, tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert find_problems(job("sft", recipe=RECIPE, prompt_data=str(empty))) == [
        f"--prompt-data {empty}: no preference rows"
    ]


def test_the_reader_refuses_what_the_preflight_refuses(tmp_path: Path) -> None:
    from miles.config.resolve import resolve
    from miles.core.errors import ConfigError
    from miles.training.preference_rows import read_preference_rows

    _images(tmp_path, "a.png", "b.png")
    path = write_lines(tmp_path / "prefs.jsonl", [_row(), _row(chosen=7)])
    args = resolve("sft", recipe=RECIPE, cli={"prompt_data": str(path)}).args
    with pytest.raises(ConfigError, match=r"prefs.jsonl:2: 'chosen' \(--chosen-key\) must be an image file path"):
        read_preference_rows(path, args)
