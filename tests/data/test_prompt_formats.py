"""The formats of prompt data (`miles.data.formats`): JSONL, a plain-text list, Parquet (written with pyarrow's real
writer) and a `datasets` folder (written with the real `Dataset.save_to_disk`) read to the same records, and each
problem is one line naming `file:line` or `file:row N`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from miles.core.errors import ConfigError
from miles.data.formats import FORMATS, format_of
from miles.data.prompt_file import PromptKeys
from miles.data.prompts import iter_prompt_rows, load_prompts

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

ROWS: list[dict[str, Any]] = [
    {"input": "make the digit a 7", "metadata": {"label": 7}, "media": [{"role": "condition", "image": "src.png"}]},
    {"input": 'a sign that says "miles"', "metadata": {"rm_type": "ocr"}},
    {"input": "the digit 3", "metadata": {"label": 3, "tags": ["x"]}, "media": []},
]


def _jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def _parquet(path: Path, rows: list[dict[str, Any]], **kw: Any) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path, **kw)
    return path


def _hf(folder: Path, rows: list[dict[str, Any]], **kw: Any) -> Path:
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(rows).save_to_disk(str(folder), **kw)
    return folder


def _fields(records: list[Any]) -> list[tuple[Any, ...]]:
    return [(r.prompt, r.metadata, [(m.role, m.kind, m.path.name, m.written) for m in r.media]) for r in records]


def test_every_format_reads_the_same_records(tmp_path: Path) -> None:
    jsonl = load_prompts(_jsonl(tmp_path / "p.jsonl", ROWS))
    parquet = load_prompts(_parquet(tmp_path / "p.parquet", ROWS))
    hf = load_prompts(_hf(tmp_path / "hf", ROWS))
    assert _fields(parquet) == _fields(jsonl) == _fields(hf)
    assert [r.line for r in jsonl] == [1, 2, 3] and [r.line for r in parquet] == [r.line for r in hf] == [0, 1, 2]
    assert parquet[0].media[0].path == tmp_path / "src.png"  # relative to the file's folder
    assert hf[0].media[0].path == tmp_path / "hf" / "src.png"  # relative to the data set's folder
    (tmp_path / "p.txt").write_text("\n".join(r["input"] for r in ROWS) + "\n")
    assert [r.prompt for r in load_prompts(tmp_path / "p.txt")] == [r["input"] for r in ROWS]


def test_the_extension_picks_the_format(tmp_path: Path) -> None:
    names = {"a.jsonl": "jsonl", "a.JSON": "jsonl", "a.ndjson": "jsonl", "7": "jsonl", "a.txt": "txt"}
    names |= {"a.parquet": "parquet"}
    assert {name: format_of(tmp_path / name) for name in names} == names
    assert format_of(_hf(tmp_path / "hf", ROWS[:1])) == "hf"
    assert set(FORMATS) == {"jsonl", "txt", "parquet", "hf"}


def test_an_unknown_extension_is_refused_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "prompts.csv"
    path.write_text("input\nx\n")
    with pytest.raises(ConfigError) as info:
        load_prompts(path)
    assert str(info.value) == (
        f"{path}: unknown prompt data format '.csv' (by its extension); miles reads .jsonl, .json, .ndjson, .txt, "
        ".parquet files and a folder Dataset.save_to_disk wrote"
    )


def test_a_text_list_skips_blank_lines_and_names_its_lines(tmp_path: Path) -> None:
    path = tmp_path / "train.txt"
    path.write_bytes(b"\xef\xbb\xbfa cat\n\n  a dog  \r\n\n")
    records = load_prompts(path)
    assert [(r.prompt, r.line, r.metadata, r.media) for r in records] == [("a cat", 1, {}, ()), ("a dog", 3, {}, ())]
    path.write_bytes(b"a cat\nok\ncaf\xe9\n")
    with pytest.raises(ConfigError) as info:
        load_prompts(path)
    assert str(info.value) == f"{path}:3: not UTF-8 text (invalid continuation byte at byte 4)"
    path.write_text("\n  \n")
    with pytest.raises(ConfigError, match=r"train\.txt: no prompts \(the file is empty\)$"):
        load_prompts(path)


def test_a_text_list_reads_its_prompt_at_the_input_key(tmp_path: Path) -> None:
    path = tmp_path / "p.txt"
    path.write_text("x\n")
    assert [(where, row) for where, row, _ in iter_prompt_rows(path, PromptKeys(input="caption"))] == [
        (f"{path}:1", {"caption": "x"})
    ]


def test_parquet_problems_name_the_row(tmp_path: Path) -> None:
    rows = [{"input": "a", "media": None}, {"input": None, "media": None}]
    path = _parquet(tmp_path / "p.parquet", rows)
    with pytest.raises(ConfigError) as info:
        load_prompts(path)
    assert str(info.value) == f"{path}:row 1: 'input' must be a string, got null"
    _parquet(path, [{"input": "a", "media": [{"role": "condition", "image": "a.png"}]}, {"input": "b", "media": []}])
    assert [len(r.media) for r in load_prompts(path)] == [1, 0]
    _parquet(path, [{"input": "a", "media": [{"role": "edit", "image": "a.png"}]}])
    with pytest.raises(ConfigError) as info:
        load_prompts(path)
    assert str(info.value) == f"{path}:row 0: 'media'[0].role 'edit' is not a media role (condition)"


def test_a_parquet_file_without_the_input_column(tmp_path: Path) -> None:
    path = _parquet(tmp_path / "p.parquet", [{"prompt": "a", "metadata": {"k": 1}}])
    with pytest.raises(ConfigError) as info:
        load_prompts(path)
    assert str(info.value) == f"{path}: no column 'input' (--input-key); columns: 'prompt', 'metadata'"
    assert [r.prompt for r in load_prompts(path, PromptKeys(input="prompt"))] == ["a"]


def test_parquet_reads_only_the_job_columns_batch_by_batch(tmp_path: Path) -> None:
    rows = [{"input": f"p{i}", "other": "x" * 10, "metadata": {"label": i % 10}} for i in range(3000)]
    rows.append({"input": "", "other": "", "metadata": {"label": 1}})
    path = _parquet(tmp_path / "p.parquet", rows, row_group_size=500)
    stream = iter_prompt_rows(path)
    where, row, record = next(stream)  # the first row, before the bad one is read
    assert (where, row, record.prompt) == (f"{path}:row 0", {"input": "p0", "metadata": {"label": 0}}, "p0")
    with pytest.raises(ConfigError) as info:
        list(stream)
    assert str(info.value) == f"{path}:row 3000: 'input' is empty"


def test_a_parquet_cell_that_is_not_utf8(tmp_path: Path) -> None:
    offsets = pa.py_buffer(b"\x00\x00\x00\x00\x02\x00\x00\x00\x04\x00\x00\x00")
    column = pa.Array.from_buffers(pa.string(), 2, [None, offsets, pa.py_buffer(b"ok\xff\xfe")])
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"input": column}), path)
    with pytest.raises(ConfigError) as info:
        load_prompts(path)
    assert str(info.value) == f"{path}:row 1: not UTF-8 text (invalid start byte at byte 1)"


def test_a_file_that_is_not_parquet(tmp_path: Path) -> None:
    path = tmp_path / "p.parquet"
    path.write_bytes(b"not parquet at all")
    with pytest.raises(ConfigError) as info:
        load_prompts(path)
    message = str(info.value)
    assert message.startswith(f"{path}: not a Parquet file PyArrow reads (") and "\n" not in message


def test_a_datasets_folder_names_its_rows_across_shards(tmp_path: Path) -> None:
    rows = [{"input": f"p{i}", "metadata": {"label": i % 10}} for i in range(5)] + [{"input": None, "metadata": None}]
    folder = _hf(tmp_path / "hf", rows, num_shards=3)
    assert len(list(folder.glob("*.arrow"))) == 3
    with pytest.raises(ConfigError) as info:
        load_prompts(folder)
    assert str(info.value) == f"{folder}:row 5: 'input' must be a string, got null"
    good = _hf(tmp_path / "good", rows[:5], num_shards=2)
    assert [(r.prompt, r.line) for r in load_prompts(good)] == [(f"p{i}", i) for i in range(5)]


def test_a_dataset_dict_folder_names_its_splits(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    folder = tmp_path / "dd"
    split = datasets.Dataset.from_list(ROWS[:1])
    datasets.DatasetDict({"train": split, "test": split}).save_to_disk(str(folder))
    with pytest.raises(ConfigError) as info:
        load_prompts(folder)
    assert str(info.value) == (
        f"{folder}: is a DatasetDict folder (splits: test, train), not one data set; name one split's folder, "
        f"e.g. {folder / 'test'}"
    )
    assert [r.prompt for r in load_prompts(folder / "train")] == [ROWS[0]["input"]]


def test_a_datasets_folder_missing_a_data_file(tmp_path: Path) -> None:
    folder = _hf(tmp_path / "hf", ROWS)
    (arrow,) = folder.glob("*.arrow")
    arrow.unlink()
    with pytest.raises(ConfigError) as info:
        load_prompts(folder)
    assert str(info.value) == f"{folder}: state.json names {arrow.name}, which is not in the folder"


def test_a_missing_pyarrow_breaks_only_the_columnar_formats(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _parquet(tmp_path / "p.parquet", ROWS)
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # `import pyarrow` raises ImportError
    assert [r.prompt for r in load_prompts(_jsonl(tmp_path / "p.jsonl", ROWS))] == [r["input"] for r in ROWS]
    with pytest.raises(ConfigError) as info:
        load_prompts(path)
    assert str(info.value) == f"{path}: reading it needs pyarrow (pip install pyarrow)"


def test_the_reader_imports_neither_pyarrow_nor_pil_nor_torch() -> None:
    root = Path(__file__).resolve().parents[2]
    code = (
        "import sys, miles.data.prompts, miles.data.formats, miles.preflight.data\n"
        "print(','.join(m for m in ('pyarrow', 'PIL', 'torch', 'datasets') if m in sys.modules))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ""
