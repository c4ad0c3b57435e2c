"""Prompt JSONL reading, per-epoch shuffling, grouping, buffer, resume and hook loading."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from miles.config.args import Args
from miles.config.resolution import schema_args
from miles.core.errors import ConfigError
from miles.core.sample import Sample
from miles.data.prompt_file import PromptKeys
from miles.rollout.data_source import (
    RolloutDataSource,
    RolloutDataSourceWithBuffer,
    load_data_source,
    load_prompts,
    num_rollout_for,
    pop_first,
)
from miles.utils.hooks import load_function


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def make_args(prompt_data, **kw) -> Args:
    base = dict(
        prompt_data=str(prompt_data),
        n_samples_per_prompt=2,
        rollout_batch_size=3,
        rollout_seed=42,  # the seeds the tests expect
    )
    base.update(kw)
    return schema_args(**base)


@pytest.fixture
def prompts_file(tmp_path: Path) -> Path:
    rows = [{"input": f"p{i}", "metadata": {"label": i, "nested": {"k": [i]}}} for i in range(7)]
    return write_jsonl(tmp_path / "prompts.jsonl", rows)


# --- JSONL errors ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bad_line", "needle"),
    [
        ('{"input": "ok"', "malformed JSON"),
        ("[1, 2]", "expected a JSON object, got a list"),
        ('{"prompt": "x"}', "missing key 'input'"),
        ('{"input": ""}', "'input' is empty"),
        ('{"input": "   "}', "'input' is empty"),
        ('{"input": 3}', "'input' must be a string"),
        ('{"input": "x", "metadata": [1]}', "'metadata' (--metadata-key) must be a dict"),
    ],
)
def test_bad_line_names_file_and_line(tmp_path: Path, bad_line: str, needle: str) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", [{"input": "a"}, "", bad_line, {"input": "b"}])
    with pytest.raises(ConfigError) as info:
        load_prompts(path)
    message = str(info.value)
    assert f"{path}:3:" in message
    assert needle in message
    assert "\n" not in message


def test_missing_key_names_the_custom_key(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", [{"text": "a"}, {"input": "b"}])
    with pytest.raises(ConfigError, match=r"p\.jsonl:2: missing key 'text' \(--input-key\)"):
        load_prompts(path, PromptKeys(input="text"))


def test_reader_keeps_metadata_and_skips_blank_lines(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", [{"input": "a", "metadata": {"rm_type": "ocr"}}, "", {"input": "b"}])
    records = load_prompts(path)
    assert [(r.prompt, r.metadata, r.line) for r in records] == [("a", {"rm_type": "ocr"}, 1), ("b", {}, 3)]


def test_missing_and_empty_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_prompts(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ConfigError, match="no prompts"):
        load_prompts(tmp_path / "empty.jsonl")


def test_bad_data_source_file_error_from_args(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", [{"input": "a"}, "{oops"])
    with pytest.raises(ConfigError, match=r"p\.jsonl:2: malformed JSON"):
        RolloutDataSource(make_args(path))


# --- grouping, shuffling, epochs -----------------------------------------------------------------


def test_groups_of_n_with_indices_seeds_and_copied_metadata(prompts_file: Path) -> None:
    source = RolloutDataSource(make_args(prompts_file, n_samples_per_prompt=3))
    groups = source.get_samples(2)
    assert [len(g) for g in groups] == [3, 3]
    flat = [s for g in groups for s in g]
    assert [s.index for s in flat] == list(range(6))
    assert [s.group_index for s in flat] == [0, 0, 0, 1, 1, 1]
    for group in groups:
        assert len({s.prompt for s in group}) == 1
        base = (42 + group[0].group_index * 3) % 2**31  # the documented seed layout
        assert [s.seed for s in group] == [base, base + 1, base + 2]
    # metadata is a deep copy per sample: mutating one leaves the others and the data set alone
    groups[0][0].metadata["nested"]["k"].append("x")
    assert groups[0][1].metadata["nested"]["k"] != groups[0][0].metadata["nested"]["k"]
    assert all(r.metadata["nested"]["k"] == [r.metadata["label"]] for r in source.dataset)


def _epoch_prompts(source: RolloutDataSource, size: int) -> list[str]:
    return [g[0].prompt for g in source.get_samples(size)]


def test_shuffle_is_deterministic_per_seed_and_differs_per_epoch(prompts_file: Path) -> None:
    a = RolloutDataSource(make_args(prompts_file, n_samples_per_prompt=1))
    b = RolloutDataSource(make_args(prompts_file, n_samples_per_prompt=1))
    a_epochs = [_epoch_prompts(a, 7) for _ in range(3)]
    b_epochs = [_epoch_prompts(b, 7) for _ in range(3)]
    assert a_epochs == b_epochs
    for epoch in a_epochs:
        assert sorted(epoch) == [f"p{i}" for i in range(7)]  # each epoch is a permutation
    assert len({tuple(e) for e in a_epochs}) > 1  # epoch-dependent
    other = RolloutDataSource(make_args(prompts_file, n_samples_per_prompt=1, seed=99))
    assert [_epoch_prompts(other, 7) for _ in range(3)] != a_epochs


def test_group_index_monotonic_across_calls_and_epochs(prompts_file: Path) -> None:
    source = RolloutDataSource(make_args(prompts_file))
    seen = []
    for size in (3, 3, 3, 4, 1):  # 14 prompts: two epochs of 7, batches straddle the boundary
        groups = source.get_samples(size)
        assert [s.index for g in groups for s in g] == list(range(2 * size))
        seen += [g[0].group_index for g in groups]
        assert all(s.group_index == g[0].group_index for g in groups for s in g)
    assert seen == list(range(14))
    assert source.epoch == 1 and source.offset == 7


def test_state_save_restore_resumes_identically(prompts_file: Path, tmp_path: Path) -> None:
    args = make_args(prompts_file)
    source = RolloutDataSource(args)
    source.get_samples(5)
    source.save(tmp_path / "state" / "data_source.json")
    expected = [[(s.prompt, s.group_index, s.seed) for s in g] for g in source.get_samples(6)]

    resumed = RolloutDataSource(args)
    resumed.load(tmp_path / "state" / "data_source.json")
    assert resumed.state_dict() == {**source.state_dict(), "epoch": 0, "offset": 5, "group_counter": 5}
    got = [[(s.prompt, s.group_index, s.seed) for s in g] for g in resumed.get_samples(6)]
    assert got == expected

    again = RolloutDataSource(args)
    again.load_state_dict(json.loads((tmp_path / "state" / "data_source.json").read_text()))
    assert [[(s.prompt, s.group_index) for s in g] for g in again.get_samples(6)] == [
        [(p, gi) for p, gi, _ in g] for g in expected
    ]


def test_load_state_errors(prompts_file: Path, tmp_path: Path) -> None:
    source = RolloutDataSource(make_args(prompts_file))
    with pytest.raises(ConfigError, match="not found"):
        source.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ConfigError, match=r"bad\.json: not a data source state file"):
        source.load(tmp_path / "bad.json")
    (tmp_path / "partial.json").write_text('{"epoch": 1}')
    with pytest.raises(ConfigError, match=r"partial\.json: .*missing or bad field"):
        source.load(tmp_path / "partial.json")


def test_num_rollout_derivation() -> None:
    assert num_rollout_for(SimpleNamespace(num_rollout=5, num_epoch=3, rollout_batch_size=4), 100) == 5
    assert num_rollout_for(SimpleNamespace(num_rollout=None, num_epoch=None, rollout_batch_size=4), 10) == 3
    assert num_rollout_for(SimpleNamespace(num_rollout=None, num_epoch=2, rollout_batch_size=4), 8) == 4
    with pytest.raises(ConfigError, match="--rollout-batch-size"):
        num_rollout_for(SimpleNamespace(num_rollout=None, num_epoch=1, rollout_batch_size=None), 8)


def test_builtin_dataset_and_real_args() -> None:
    from miles.config.resolve import resolve

    cli = {
        "hf_checkpoint": "tiny-sd3",
        "prompt_data": "digits:train",
        "rollout_batch_size": 4,
        "n_samples_per_prompt": 2,
        "diffusion_num_sde_steps": 2,
        "rm_type": "digit",
    }
    try:
        args = resolve("rl", cli=cli).args
    except ConfigError as exc:  # the rl rules may evolve; the data source only needs these attributes
        pytest.skip(f"rl args did not resolve here: {exc}")
    source = load_data_source(args)
    assert isinstance(source, RolloutDataSourceWithBuffer)
    groups = source.get_samples(4)
    assert len(groups) == 4 and all(len(g) == 2 for g in groups)
    assert all(isinstance(s.prompt, str) and s.prompt for g in groups for s in g)
    assert source.num_rollout() == num_rollout_for(args, len(source))


def test_disabled_global_dataset_needs_a_custom_source(prompts_file: Path) -> None:
    source = RolloutDataSource(make_args(prompts_file, disable_rollout_global_dataset=True))
    assert len(source) == 0
    with pytest.raises(ConfigError, match="no global data set"):
        source.get_samples(1)


# --- buffer -----------------------------------------------------------------------------------


def test_buffer_is_served_first_then_new_prompts(prompts_file: Path) -> None:
    source = RolloutDataSourceWithBuffer(make_args(prompts_file))
    first = source.get_samples(3)
    source.add_samples([first[1]])
    assert source.get_buffer_length() == 1
    nxt = source.get_samples(2)
    assert nxt[0][0].group_index == first[1][0].group_index  # the buffered group keeps its group_index
    assert nxt[1][0].group_index == 3
    assert [s.index for g in nxt for s in g] == [0, 1, 2, 3]
    assert source.get_buffer_length() == 0
    with pytest.raises(ValueError, match="expected n_samples_per_prompt=2"):
        source.add_samples([first[0][:1]])


def limit_one(args, rollout_id, buffer, num_samples):
    return pop_first(args, rollout_id, buffer, min(1, num_samples))


def test_custom_buffer_filter(prompts_file: Path) -> None:
    source = RolloutDataSourceWithBuffer(make_args(prompts_file, buffer_filter_path=f"{__name__}.limit_one"))
    groups = source.get_samples(3)
    source.add_samples(groups)
    out = source.get_samples(3)
    assert [g[0].group_index for g in out] == [0, 3, 4]
    assert source.get_buffer_length() == 2


class MySource(RolloutDataSource):
    pass


def test_load_data_source_by_path_and_errors(prompts_file: Path) -> None:
    assert type(load_data_source(make_args(prompts_file, data_source_path=f"{__name__}.MySource"))) is MySource
    with pytest.raises(ConfigError, match=r"--data-source-path 'no_such_pkg\.mod\.Cls': cannot import"):
        load_data_source(make_args(prompts_file, data_source_path="no_such_pkg.mod.Cls"))
    with pytest.raises(ConfigError, match=r"--data-source-path .* has no attribute 'Nope'"):
        load_data_source(make_args(prompts_file, data_source_path=f"{__name__}.Nope"))
    with pytest.raises(ConfigError, match="not a class"):
        load_data_source(make_args(prompts_file, data_source_path=f"{__name__}.limit_one"))


def test_load_function_forms_and_errors() -> None:
    assert load_function("miles.rollout.data_source.pop_first", "--x") is pop_first
    assert load_function("miles.rollout.data_source:pop_first", "--x") is pop_first
    assert load_function("miles.core.sample.Sample.from_dict", "--x") == Sample.from_dict
    with pytest.raises(ConfigError, match=r"^--buffer-filter-path 'nodots': expected a dotted path"):
        load_function("nodots", "--buffer-filter-path")
    with pytest.raises(ConfigError, match="not a function"):
        load_function("miles.rollout.data_source.STATE_VERSION", "--x")
