"""Condition media on data rows: the records the reader makes, and every malformed list as one line naming
`file:line`, the key and the entry."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from miles.core.errors import ConfigError
from miles.data.media import MediaRef
from miles.data.prompt_file import PromptKeys
from miles.data.prompts import check_sft_row, load_prompts


def _write(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def test_a_row_without_media_reads_as_before(tmp_path: Path) -> None:
    path = _write(tmp_path / "p.jsonl", [{"input": "a", "metadata": {"label": 1}}, {"input": "b", "media": None}])
    records = load_prompts(path)
    assert [(r.prompt, r.metadata, r.line, r.media) for r in records] == [("a", {"label": 1}, 1, ()), ("b", {}, 2, ())]


def test_media_paths_are_relative_to_the_data_files_folder_or_absolute(tmp_path: Path) -> None:
    folder = tmp_path / "data"
    folder.mkdir()
    media = [
        {"role": "condition", "image": "src.png"},
        {"role": "condition", "image": "../shared/ref.png"},
        {"role": "condition", "image": "/abs/first.png"},
        {"role": "condition", "video": "clips/a.webp", "image": None},
    ]
    path = _write(folder / "p.jsonl", [{"input": "make the digit a 7", "media": media}])
    (record,) = load_prompts(path)
    assert record.media == (
        MediaRef("condition", "image", folder / "src.png", "src.png"),
        MediaRef("condition", "image", tmp_path / "shared" / "ref.png", "../shared/ref.png"),
        MediaRef("condition", "image", Path("/abs/first.png"), "/abs/first.png"),
        MediaRef("condition", "video", folder / "clips" / "a.webp", "clips/a.webp"),
    )


def test_a_relative_data_path_still_gives_absolute_media_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    _write(tmp_path / "p.jsonl", [{"input": "x", "media": [{"role": "condition", "image": "a.png"}]}])
    (record,) = load_prompts("p.jsonl")
    assert record.media[0].path == tmp_path / "a.png"


@pytest.mark.parametrize(
    ("media", "why"),
    [
        (
            {"role": "condition", "image": "a.png"},
            "'media' (--media-key) must be a list of media objects, got an object",
        ),
        ("a.png", "'media' (--media-key) must be a list of media objects, got a string"),
        (["a.png"], "'media'[0] must be an object like {'role': 'condition', 'image': 'src.png'}, got a string"),
        ([{"image": "a.png"}], "'media'[0] has no 'role' (condition)"),
        ([{"role": "target", "image": "a.png"}], "'media'[0].role 'target' is not a media role (condition)"),
        ([{"role": 3, "image": "a.png"}], "'media'[0].role 3 is not a media role (condition)"),
        (
            [{"role": "condition", "uri": "a.png"}],
            "'media'[0] names no file: give 'image' or 'video'; keys: 'role', 'uri'",
        ),
        (
            [{"role": "condition", "image": "a.png", "video": "a.webp"}],
            "'media'[0] names both 'image' and 'video'; give one file per entry",
        ),
        ([{"role": "condition", "image": 7}], "'media'[0].image must be a file path, got a number"),
        ([{"role": "condition", "image": ["a.png"]}], "'media'[0].image must be a file path, got a list"),
        ([{"role": "condition", "image": "  "}], "'media'[0].image is empty"),
        (
            [{"role": "condition", "image": "a.png"}, {"role": "condition", "video": ""}],
            "'media'[1].video is empty",
        ),
        (
            [{"role": "condition", "image": "https://example.com/a.png"}],
            "'media'[0].image https://example.com/a.png: is a URL, and miles does not read URLs; download it and give "
            "a local image file",
        ),
    ],
)
def test_a_malformed_media_list_is_one_line_naming_file_and_line(tmp_path: Path, media: Any, why: str) -> None:
    path = _write(tmp_path / "p.jsonl", [{"input": "fine"}, {"input": "x", "media": media}])
    with pytest.raises(ConfigError) as info:
        load_prompts(path)
    assert str(info.value) == f"{path}:2: {why}"


def test_a_huge_value_is_quoted_clipped(tmp_path: Path) -> None:
    path = _write(tmp_path / "p.jsonl", [{"input": "x", "media": [{"role": "r" * 5000, "image": "a.png"}]}])
    with pytest.raises(ConfigError) as info:
        load_prompts(path)
    message = str(info.value)
    assert message.startswith(f"{path}:1: 'media'[0].role 'rrrr") and "(5,000 chars)" in message
    assert len(message) < 200 + len(str(path)) and "\n" not in message


def test_the_media_key_follows_its_flag(tmp_path: Path) -> None:
    rows = [{"input": "x", "refs": [{"role": "condition", "image": "a.png"}], "media": "ignored"}]
    path = _write(tmp_path / "p.jsonl", rows)
    (record,) = load_prompts(path, PromptKeys(media="refs"))
    assert record.media == (MediaRef("condition", "image", tmp_path / "a.png", "a.png"),)
    _write(path, [{"input": "x", "refs": "a.png"}])
    with pytest.raises(ConfigError, match=r"p\.jsonl:1: 'refs' \(--media-key\) must be a list"):
        load_prompts(path, PromptKeys(media="refs"))


def test_the_eval_keys_default_to_the_training_keys() -> None:
    args = SimpleNamespace(
        input_key="input", metadata_key="metadata", media_key="refs", eval_input_key=None, eval_media_key=None
    )
    assert PromptKeys.of(args) == PromptKeys("input", "metadata", "refs")
    assert PromptKeys.of(args, evaluation=True) == PromptKeys("input", "metadata", "refs")
    args.eval_input_key, args.eval_media_key = "caption", "sources"
    assert PromptKeys.of(args, evaluation=True) == PromptKeys("caption", "metadata", "sources")
    assert PromptKeys.of(args) == PromptKeys("input", "metadata", "refs")


def test_an_sft_row_may_carry_media(tmp_path: Path) -> None:
    row = {"image": "target.png", "input": "make it a 7", "media": [{"role": "condition", "image": "src.png"}]}
    assert check_sft_row("f:1", row, PromptKeys(), tmp_path) == (
        MediaRef("condition", "image", tmp_path / "src.png", "src.png"),
    )
    assert check_sft_row("f:1", {"image": "t.png", "input": "x"}, PromptKeys(), tmp_path) == ()
    with pytest.raises(ConfigError, match=r"^f:1: 'media'\[0\] has no 'role' \(condition\)$"):
        check_sft_row("f:1", row | {"media": [{"image": "src.png"}]}, PromptKeys(), tmp_path)


def test_a_preference_row_may_carry_media(tmp_path: Path) -> None:
    from miles.training.preference_rows import read_preference_rows

    args = SimpleNamespace(
        input_key="input", chosen_key="chosen", rejected_key="rejected", metadata_key="metadata", media_key="media"
    )
    edit = {"input": "make it a 7", "chosen": "a.png", "rejected": "b.png"}
    path = _write(tmp_path / "prefs.jsonl", [edit | {"media": [{"role": "condition", "image": "src.png"}]}, edit])
    first, second = read_preference_rows(path, args)
    assert first.media == (MediaRef("condition", "image", tmp_path / "src.png", "src.png"),)
    assert (second.caption, second.chosen, second.rejected, second.metadata, second.media) == (
        "make it a 7",
        "a.png",
        "b.png",
        {},
        (),
    )
    _write(path, [edit | {"media": [{"role": "condition"}]}])
    with pytest.raises(ConfigError, match=r"prefs\.jsonl:1: 'media'\[0\] names no file"):
        read_preference_rows(path, args)
