"""The prompt-data and evaluation flags on the functions that read them: which keys of a JSONL row are the prompt
and its metadata, which eval datasets there are and how many samples each prompt gets, and which reward the eval
reports. Fast: small JSONL/YAML files, no engine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from miles.config.resolve import resolve
from miles.core.errors import ConfigError
from miles.core.sample import Sample
from miles.rollout.data_source import RolloutDataSource
from miles.rollout.evaluation import eval_datasets, eval_groups, eval_metrics

JOB = {
    "hf_checkpoint": "tiny-sd3",
    "rm_type": "digit",
    "rollout_batch_size": 2,
    "n_samples_per_prompt": 2,
    "diffusion_num_sde_steps": 2,
    "actor_num_gpus_per_node": 1,
    "num_gpus_per_node": 1,
}


def jsonl(path: Path, rows: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def rl_args(**cli: Any) -> Any:
    return resolve("rl", cli={**JOB, **cli}).args


def test_data_source_reads_the_input_and_metadata_keys(tmp_path: Path) -> None:
    rows = [{"text": "a cat", "info": {"label": 1}, "input": "not this", "metadata": {"label": 9}}]
    data = jsonl(tmp_path / "p.jsonl", rows)
    (group,) = RolloutDataSource(rl_args(prompt_data=data, input_key="text", metadata_key="info")).get_samples(1)
    assert [(s.prompt, s.metadata) for s in group] == [("a cat", {"label": 1})] * 2
    (group,) = RolloutDataSource(rl_args(prompt_data=data)).get_samples(1)  # the defaults: input, metadata
    assert group[0].prompt == "not this" and group[0].metadata == {"label": 9}


def test_eval_prompt_data_names_the_datasets_and_their_samples(tmp_path: Path) -> None:
    a, b = jsonl(tmp_path / "a.jsonl", [{"input": "x"}]), jsonl(tmp_path / "b.jsonl", [{"input": "y"}])
    args = rl_args(prompt_data=a, eval_prompt_data=[f"first={a}", f"second={b}"], n_samples_per_eval_prompt=3)
    assert [(d.name, d.path, d.n_samples_per_prompt) for d in eval_datasets(args)] == [
        ("first", a, 3),
        ("second", b, 3),
    ]
    (group,) = eval_groups(args, eval_datasets(args)[1])
    assert [s.prompt for s in group] == ["y"] * 3 and len({s.seed for s in group}) == 3


def test_eval_config_lists_the_datasets(tmp_path: Path) -> None:
    a, b = jsonl(tmp_path / "a.jsonl", [{"input": "x"}]), jsonl(tmp_path / "b.jsonl", [{"input": "y"}])
    config = tmp_path / "eval.yaml"
    config.write_text(
        f"datasets:\n  - {{name: few, path: {a}}}\n  - {{name: many, path: {b}, n_samples_per_eval_prompt: 5, "
        "num_steps: 4}\n"
    )
    args = resolve("eval", cli={**JOB, "eval_config": str(config), "n_samples_per_eval_prompt": 2}).args
    datasets = eval_datasets(args)
    assert [(d.name, d.path, d.n_samples_per_prompt, d.num_steps) for d in datasets] == [
        ("few", a, 2, None),  # --n-samples-per-eval-prompt unless the dataset sets its own
        ("many", b, 5, 4),
    ]


@pytest.mark.parametrize(
    ("text", "why"),
    [(None, "no such file"), ("datasets: []\n", "non-empty 'datasets' list"), ("datasets: [{name: x}]\n", "needs")],
)
def test_eval_config_errors_name_the_flag(tmp_path: Path, text: str | None, why: str) -> None:
    config = tmp_path / "eval.yaml"
    if text is not None:
        config.write_text(text)
    args = resolve("eval", cli={**JOB, "eval_config": str(config)}).args
    with pytest.raises(ConfigError, match=rf"^--eval-config {config}: .*{why}"):
        eval_datasets(args)


def test_eval_groups_read_the_eval_input_key(tmp_path: Path) -> None:
    data = jsonl(tmp_path / "e.jsonl", [{"input": "rollout prompt", "caption": "eval prompt", "metadata": {"k": 1}}])
    args = rl_args(prompt_data=data, eval_prompt_data=[f"e={data}"], eval_input_key="caption")
    (group,) = eval_groups(args, eval_datasets(args)[0])
    assert group[0].prompt == "eval prompt" and group[0].metadata == {"k": 1}
    (group,) = eval_groups(rl_args(prompt_data=data, eval_prompt_data=[f"e={data}"]), eval_datasets(args)[0])
    assert group[0].prompt == "rollout prompt"  # without it: --input-key


def test_eval_reward_key_picks_the_eval_reward(tmp_path: Path) -> None:
    samples = [
        Sample(index=i, group_index=i, prompt="p", reward={"train": 0.0, "quality": float(i)}) for i in range(3)
    ]
    args = rl_args(prompt_data="p.jsonl", reward_key="train", eval_reward_key="quality")
    assert eval_metrics(args, "d", samples)["eval/d/reward_mean"] == pytest.approx(1.0)
    without = rl_args(prompt_data="p.jsonl", reward_key="train")
    assert eval_metrics(without, "d", samples)["eval/d/reward_mean"] == 0.0  # falls back to --reward-key
