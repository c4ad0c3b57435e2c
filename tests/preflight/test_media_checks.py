"""The preflight of condition media (`miles.data.media`): every medium a prompt, SFT or preference row names must be
a regular file that decodes, each problem one line naming `file:line` (or `file:row N`) and the path as written;
other formats of prompt data go through the same checks; the CLI exits 2 with that line before Ray starts."""

from __future__ import annotations

import re
import struct
import zlib
from pathlib import Path
from typing import Any

import pytest
from preflight_helpers import Job, digit_prompts, write_lines

from miles.core.errors import ConfigError
from miles.data.prompt_file import PromptKeys
from miles.preflight import find_problems
from miles_cli.main import main

_FIX = "; fix or remove that line"


def _png(path: Path, size: tuple[int, int] = (8, 8)) -> Path:
    from PIL import Image

    Image.new("RGB", size, (200, 10, 10)).save(path)
    return path


def _png_header(path: Path, width: int, height: int) -> Path:
    """A PNG whose header claims `width x height` pixels, followed by a few bytes of pixel data: what a
    decompression bomb looks like before it is decoded."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")
    )
    return path


def _edit(image: Any, **extra: Any) -> dict[str, Any]:
    return {"input": "the digit 7", "metadata": {"label": 7}, "media": [{"role": "condition", "image": image}]} | extra


@pytest.fixture
def edit(job: Job) -> Job:
    """`edit(name, **flags)`: a job of the edit model (tiny-flux-kontext's recipes), whose rows carry one source."""

    def make(name: str = "rl", **cli: Any):
        recipe = "tiny-flux-kontext-edit-sft" if name == "sft" else "tiny-flux-kontext-edit-grpo"
        return job(name, recipe=cli.pop("recipe", recipe), **cli)

    return make


def test_rows_whose_media_exist_and_decode_pass(edit: Job, tmp_path: Path) -> None:
    from miles.preflight.data import DataCount, scan_prompt_file

    _png(tmp_path / "src.png")
    _png(tmp_path / "big.png", (300, 200))
    rows = [_edit("src.png"), _edit(str(tmp_path / "big.png"))]
    path = write_lines(tmp_path / "p.jsonl", rows)
    assert find_problems(edit("rl", prompt_data=str(path))) == []
    mixed = write_lines(tmp_path / "mixed.jsonl", [rows[0], *digit_prompts(2), rows[1]])
    assert scan_prompt_file(mixed, PromptKeys(), []) == DataCount(rows=4, with_media=2)


def test_the_rows_carry_as_many_sources_as_the_model_edits(job: Job, edit: Job, tmp_path: Path) -> None:
    """An edit model refuses a row without its source, a text-to-image model a row with one (it would ignore it);
    a built-in data set is checked by the config, before any file is read."""
    _png(tmp_path / "src.png")
    path = write_lines(tmp_path / "p.jsonl", [_edit("src.png"), *digit_prompts(1)])
    assert find_problems(edit("rl", prompt_data=str(path))) == [
        f"--prompt-data {path}:2: model family 'flux_kontext' edits 1 condition image(s) per row and the row carries "
        "0 at 'media': give each row its source as {'media': [{'role': 'condition', 'image': 'src.png'}]}" + _FIX
    ]
    two = write_lines(
        tmp_path / "two.jsonl", [_edit("src.png", media=[{"role": "condition", "image": "src.png"}] * 2)]
    )
    (line,) = find_problems(edit("rl", prompt_data=str(two)))
    assert line.startswith(f"--prompt-data {two}:1: model family 'flux_kontext' edits 1 condition image(s) per row")
    assert find_problems(job("rl", prompt_data=str(path))) == [
        f"--prompt-data {path}:1: the row carries 1 condition image(s) at 'media' but model family 'sd3' generates "
        "from text alone; use a family that takes them (flux_kontext, ...) or rows without media" + _FIX
    ]
    with pytest.raises(
        ConfigError, match=r"its rows carry 1 condition image\(s\) \(an edit task\) and model family 'sd3'"
    ):
        job("rl", prompt_data="digits-edit:train")
    with pytest.raises(ConfigError, match=r"its rows carry no condition image and model family 'flux_kontext'"):
        edit("rl", prompt_data="digits:labels")


def test_a_missing_media_file_names_the_line_and_the_path_as_written(edit: Job, tmp_path: Path) -> None:
    _png(tmp_path / "src.png")
    path = write_lines(tmp_path / "p.jsonl", [_edit("src.png"), _edit("nope.png")])
    assert find_problems(edit("rl", prompt_data=str(path))) == [
        f"--prompt-data {path}:2: 'media'[0].image 'nope.png' not found (looked for {tmp_path / 'nope.png'}){_FIX}"
    ]
    absolute = str(tmp_path / "gone.png")
    path = write_lines(tmp_path / "p.jsonl", [_edit(absolute)])
    assert find_problems(edit("rl", prompt_data=str(path))) == [
        f"--prompt-data {path}:1: 'media'[0].image {absolute!r} not found{_FIX}"
    ]


def test_a_directory_and_a_device_are_not_media_files(edit: Job, tmp_path: Path) -> None:
    (tmp_path / "imgs").mkdir()
    path = write_lines(tmp_path / "p.jsonl", [_edit("imgs")])
    assert find_problems(edit("rl", prompt_data=str(path))) == [
        f"--prompt-data {path}:1: 'media'[0].image 'imgs' is a directory, not a file{_FIX}"
    ]
    path = write_lines(tmp_path / "p.jsonl", [_edit("/dev/null")])
    assert find_problems(edit("rl", prompt_data=str(path))) == [
        f"--prompt-data {path}:1: 'media'[0].image '/dev/null' is not a regular file (a device, FIFO or socket){_FIX}"
    ]


def test_a_media_file_that_does_not_decode(edit: Job, tmp_path: Path) -> None:
    (tmp_path / "x.png").write_bytes(b"\x00garbage bytes, not an image")
    whole = _png(tmp_path / "whole.png", (32, 32)).read_bytes()
    (tmp_path / "cut.png").write_bytes(whole[: len(whole) // 2])
    path = write_lines(tmp_path / "p.jsonl", [_edit("x.png")])
    assert find_problems(edit("rl", prompt_data=str(path))) == [
        f"--prompt-data {path}:1: 'media'[0].image 'x.png' does not decode (not an image PIL knows){_FIX}"
    ]
    path = write_lines(tmp_path / "p.jsonl", [_edit("cut.png")])
    (line,) = find_problems(edit("rl", prompt_data=str(path)))
    assert line.startswith(f"--prompt-data {path}:1: 'media'[0].image 'cut.png' does not decode (")
    assert line.endswith(_FIX) and "\n" not in line


def test_a_decompression_bomb_is_refused_before_it_is_decoded(edit: Job, tmp_path: Path) -> None:
    from miles.data.media import MAX_MEDIA_PIXELS

    assert MAX_MEDIA_PIXELS == 8192 * 8192
    _png_header(tmp_path / "bomb.png", 9000, 9000)  # above miles' cap, below PIL's own
    _png_header(tmp_path / "huge.png", 40000, 40000)  # above PIL's own: PIL refuses to open it
    path = write_lines(tmp_path / "p.jsonl", [_edit("bomb.png"), _edit("huge.png")])
    assert find_problems(edit("rl", prompt_data=str(path))) == [
        f"--prompt-data {path}:1: 'media'[0].image 'bomb.png' is 9000x9000 pixels, more than MAX_MEDIA_PIXELS "
        f"(67,108,864, miles.data.media): a decompression bomb, or the wrong file{_FIX}"
    ]
    path = write_lines(tmp_path / "p.jsonl", [_edit("huge.png")])
    assert find_problems(edit("rl", prompt_data=str(path))) == [
        f"--prompt-data {path}:1: 'media'[0].image 'huge.png' claims more than MAX_MEDIA_PIXELS (67,108,864, "
        f"miles.data.media) pixels: a decompression bomb, or the wrong file{_FIX}"
    ]


def test_a_video_medium_decodes_its_first_frame_or_exists(edit: Job, tmp_path: Path) -> None:
    from PIL import Image

    frames = [Image.new("RGB", (8, 8), (i * 40, 0, 0)) for i in range(3)]
    frames[0].save(tmp_path / "clip.gif", save_all=True, append_images=frames[1:])
    (tmp_path / "clip.mp4").write_bytes(b"read with PyAV at run time")
    (tmp_path / "bad.gif").write_bytes(b"GIF89a but then nothing")

    def row(name: str) -> dict[str, Any]:
        return {"input": "x", "metadata": {"label": 1}, "media": [{"role": "condition", "video": name}]}

    path = write_lines(tmp_path / "p.jsonl", [row("clip.gif"), row("clip.mp4")])
    assert find_problems(edit("rl", prompt_data=str(path))) == []
    path = write_lines(tmp_path / "p.jsonl", [row("clip.gif"), row("bad.gif")])
    (line,) = find_problems(edit("rl", prompt_data=str(path)))
    assert line.startswith(f"--prompt-data {path}:2: 'media'[0].video 'bad.gif' does not decode (")


def test_the_media_key_and_the_eval_media_key_follow_their_flags(job: Job, edit: Job, tmp_path: Path) -> None:
    _png(tmp_path / "src.png")
    good = {"input": "x", "metadata": {"label": 1}, "refs": [{"role": "condition", "image": "src.png"}]}
    bad = good | {"refs": [{"role": "condition", "image": "nope.png"}]}
    path = write_lines(tmp_path / "p.jsonl", [good, bad])
    assert find_problems(job("rl", prompt_data=str(path))) == []  # 'refs' is no media key: not read
    (line,) = find_problems(edit("rl", prompt_data=str(path), media_key="refs"))
    assert line.startswith(f"--prompt-data {path}:2: 'refs'[0].image 'nope.png' not found")
    train = write_lines(tmp_path / "train.jsonl", [_edit("src.png")] * 2)
    flags = {"prompt_data": str(train), "eval_prompt_data": ["held", str(path)], "eval_interval": "5"}
    (line,) = find_problems(edit("rl", **flags, eval_media_key="refs"))
    assert line == (
        f"--eval-prompt-data held {path}:2: 'refs'[0].image 'nope.png' not found (looked for "
        f"{tmp_path / 'nope.png'}){_FIX}"
    )
    refs_train = write_lines(tmp_path / "refs.jsonl", [good] * 2)
    flags["prompt_data"] = str(refs_train)
    (line,) = find_problems(edit("rl", **flags, media_key="refs"))  # the eval sets default to --media-key
    assert line.startswith(f"--eval-prompt-data held {path}:2: 'refs'[0].image 'nope.png' not found")


def test_sft_rows_with_media_are_checked(job: Job, edit: Job, tmp_path: Path) -> None:
    _png(tmp_path / "target.png")
    _png(tmp_path / "src.png")
    row = {"image": "target.png", "input": "make it red", "media": [{"role": "condition", "image": "src.png"}]}
    path = write_lines(tmp_path / "sft.jsonl", [row, row | {"input": "make it blue"}])
    assert find_problems(edit("sft", prompt_data=str(path))) == []
    path = write_lines(tmp_path / "sft.jsonl", [row, row | {"media": [{"role": "condition", "image": "gone.png"}]}])
    (line,) = find_problems(edit("sft", prompt_data=str(path)))
    assert line == (
        f"--prompt-data {path}:2: 'media'[0].image 'gone.png' not found (looked for {tmp_path / 'gone.png'}){_FIX}"
    )
    plain = write_lines(tmp_path / "plain.jsonl", [row | {"media": None}])
    (line,) = find_problems(edit("sft", prompt_data=str(plain)))
    assert line.startswith(f"--prompt-data {plain}:1: model family 'flux_kontext' edits 1 condition image(s)")
    (line,) = find_problems(job("sft", recipe="tiny-digits-sft", prompt_data=str(path)))
    assert "model family 'sd3' generates from text alone" in line


def test_preference_rows_with_media_are_checked(job: Job, tmp_path: Path) -> None:
    for name in ("a.png", "b.png", "src.png"):
        _png(tmp_path / name)
    (tmp_path / "junk.png").write_bytes(b"junk")
    row = {"input": "make it a 7", "chosen": "a.png", "rejected": "b.png", "metadata": {"label": 7}}
    with_media = row | {"media": [{"role": "condition", "image": "src.png"}]}
    path = write_lines(tmp_path / "prefs.jsonl", [with_media, row])
    assert find_problems(job("sft", recipe="tiny-digits-dpo-offline", prompt_data=str(path))) == []
    path = write_lines(tmp_path / "prefs.jsonl", [row | {"media": [{"role": "condition", "image": "junk.png"}]}])
    assert find_problems(job("sft", recipe="tiny-digits-dpo-offline", prompt_data=str(path))) == [
        f"--prompt-data {path}:1: 'media'[0].image 'junk.png' does not decode (not an image PIL knows){_FIX}"
    ]


def test_other_formats_go_through_the_same_checks(job: Job, edit: Job, tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    _png(tmp_path / "src.png")
    rows = [_edit("src.png"), _edit("nope.png")]
    path = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    assert find_problems(edit("rl", prompt_data=str(path))) == [
        f"--prompt-data {path}:row 1: 'media'[0].image 'nope.png' not found (looked for {tmp_path / 'nope.png'}){_FIX}"
    ]
    text = tmp_path / "p.txt"
    text.write_text('a sign that says "miles"\n\nthe word "flow"\n')
    assert find_problems(job("rl", prompt_data=str(text), rm_type="ocr")) == []
    text.write_text('a sign that says "miles"\n\nno quotes here\n')
    (line,) = find_problems(job("rl", prompt_data=str(text), rm_type="ocr"))
    assert line.startswith(f"--prompt-data {text}:3: ") and line.endswith(_FIX)


_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def test_the_cli_exits_2_with_the_one_line_before_ray_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray

    monkeypatch.setenv("COLUMNS", "200")
    bad = write_lines(tmp_path / "bad.jsonl", [*digit_prompts(2), _edit("missing.png")])
    argv = ["train", "rl", "--recipe", "tiny-digits-grpo", "--prompt-data", str(bad)]
    capsys.readouterr()
    code = main([*argv, "--output-dir", str(tmp_path / "out")])
    err = _ANSI.sub("", capsys.readouterr().err)
    assert code == 2
    assert err == (
        f"miles: error: --prompt-data {bad}:3: 'media'[0].image 'missing.png' not found (looked for "
        f"{tmp_path / 'missing.png'}){_FIX}\n"
    )
    assert not ray.is_initialized()
    assert not (tmp_path / "out").exists()
