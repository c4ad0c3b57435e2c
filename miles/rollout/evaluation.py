"""Eval datasets: pure generation (ODE, `--diffusion-eval-num-steps`), scored, with digit metrics.

Datasets come from `--eval-prompt-data NAME PATH` (repeatable) or `--eval-config` (a YAML/JSON file
`{datasets: [{name, path, n_samples_per_eval_prompt?, num_steps?}]}`). Metrics are reported as
`eval/<name>/<metric>`: `reward_mean` (and `reward_std`) always; for prompts whose metadata holds a
digit `label`, also `accuracy` (the digit classifier agrees with the prompt) and `fd` (Fréchet
distance of classifier features against the real digits test split); for video samples both are per
frame, and prompts whose metadata also holds a `direction` add `direction_acc` (the share of videos whose
digit travels that way; `miles.rewards.scorers.digit_metrics.digit_eval_metrics`). For an edit (every sample has a
source image) the classifier reads what `digit_edit` reads: the crop at the source digit's size around the output's
ink.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles.core.errors import ConfigError
from miles.core.sample import Sample
from miles.data.prompt_file import PromptKeys
from miles.rollout.data_source import load_prompts, resolve_prompt_data
from miles.sampling.seeds import group_sample_seeds

EVAL_SEED_OFFSET = 1_000_003  # eval seeds never collide with the training layout's first groups


@dataclass(frozen=True)
class EvalDataset:
    name: str
    path: str
    n_samples_per_prompt: int
    num_steps: int | None = None


# what an --eval-config file holds: `datasets`, a list of rows of these keys (name and path required)
EVAL_CONFIG_KEYS = ("datasets",)
DATASET_KEYS = ("name", "path", "n_samples_per_eval_prompt", "num_steps")


def eval_datasets(args: Any) -> list[EvalDataset]:
    n = int(args.n_samples_per_eval_prompt or 1)
    if args.eval_config:
        return _config_datasets(Path(args.eval_config), n)
    return [EvalDataset(name, spec, n) for name, spec in (args.eval_prompt_data or {}).items()]


def _config_datasets(path: Path, n: int) -> list[EvalDataset]:
    """The datasets of an --eval-config file; ConfigError naming `file:line: key` where the YAML gives the line."""
    from miles.config.layering import load_config_file

    label = f"--eval-config {path}"
    config = load_config_file(path, label)  # strict: a key given twice is refused
    lines = _key_lines(path)
    for key in config.data:
        if str(key) not in EVAL_CONFIG_KEYS:
            raise ConfigError(f"{config.where(str(key))}: unknown key{_did_you_mean(str(key), EVAL_CONFIG_KEYS)}")
    rows = config.data.get("datasets")
    if not isinstance(rows, list) or not rows:
        raise ConfigError(f"{label}: expected a mapping with a non-empty 'datasets' list")
    out: list[EvalDataset] = []
    first_line: dict[str, int | None] = {}
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or "name" not in row or "path" not in row:
            raise ConfigError(f"{label}: datasets[{i}] needs 'name' and 'path'")
        at = _RowKeys(label, i, lines[i] if i < len(lines) else {})
        for key in row:
            if str(key) not in DATASET_KEYS:
                raise ConfigError(f"{at(str(key))}: unknown key{_did_you_mean(str(key), DATASET_KEYS)}")
        name = _text(row["name"], "name", at("name"))
        if name in first_line:
            seen = first_line[name]
            raise ConfigError(
                f"{at('name')}: the name {name!r} is given twice" + (f" (first at line {seen})" if seen else "")
            )
        first_line[name] = at.line("name")
        out.append(
            EvalDataset(
                name,
                _text(row["path"], "path", at("path")),
                _positive_int(row.get("n_samples_per_eval_prompt", n), at("n_samples_per_eval_prompt")),
                None if row.get("num_steps") is None else _positive_int(row["num_steps"], at("num_steps")),
            )
        )
    return out


@dataclass(frozen=True)
class _RowKeys:
    """Where a key of `datasets[index]` is, for messages: `--eval-config FILE:LINE: key 'datasets[0].path'`."""

    label: str
    index: int
    lines: dict[str, int]

    def line(self, key: str) -> int | None:
        return self.lines.get(key)

    def __call__(self, key: str) -> str:
        line = self.lines.get(key)
        return f"{self.label}{f':{line}' if line else ''}: key 'datasets[{self.index}].{key}'"


def _text(value: Any, key: str, where: str) -> str:
    """A dataset's name or path: a non-empty string (a YAML number is taken as its text)."""
    from miles.data.prompt_file import kind

    what = "prompt JSONL file (or a built-in data set)" if key == "path" else "name (metrics: eval/<name>/...)"
    if value is None:
        raise ConfigError(f"{where}: {key} is null; give the dataset's {what}")
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ConfigError(f"{where}: {key} must be a string, got {kind(value)}")
    text = str(value)
    if not text.strip():
        raise ConfigError(f"{where}: {key} is empty; give the dataset's {what}")
    return text


def _did_you_mean(key: str, keys: tuple[str, ...]) -> str:
    from miles.config.flags import closest

    hint = closest(key, keys)
    return f" (did you mean {hint!r}?)" if hint else f"; known keys: {', '.join(map(repr, keys))}"


def _key_lines(path: Path) -> list[dict[str, int]]:
    """{key: line} of each row of `datasets` in the YAML file (empty where the file does not give them)."""
    from yaml import MappingNode, SequenceNode

    from miles.config.yaml_file import load_yaml

    try:
        _, root = load_yaml(path.read_text(encoding="utf-8"), str(path))
    except (OSError, UnicodeDecodeError, ConfigError):
        return []  # load_config_file has read it once already: nothing new to say
    if not isinstance(root, MappingNode):
        return []
    for key_node, value_node in root.value:
        if getattr(key_node, "value", None) == "datasets" and isinstance(value_node, SequenceNode):
            return [
                {str(k.value): k.start_mark.line + 1 for k, _ in row.value} if isinstance(row, MappingNode) else {}
                for row in value_node.value
            ]
    return []


def _positive_int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where}: expected an integer >= 1, got {value!r}")
    return value


def eval_groups(args: Any, dataset: EvalDataset) -> list[list[Sample]]:
    records = load_prompts(resolve_prompt_data(args, dataset.path), PromptKeys.of(args, evaluation=True))
    groups, index = [], 0
    n = dataset.n_samples_per_prompt
    for g, record in enumerate(records):
        seeds = group_sample_seeds(args.rollout_seed + EVAL_SEED_OFFSET, g, n)
        group = []
        for seed in seeds:
            media = tuple(str(m.path) for m in record.media)
            group.append(
                Sample(
                    index=index,
                    group_index=g,
                    prompt=record.prompt,
                    metadata=dict(record.metadata),
                    seed=seed,
                    media=media,
                )
            )
            index += 1
        groups.append(group)
    return groups


def eval_metrics(args: Any, name: str, samples: list[Sample]) -> dict[str, float]:
    rewards = [s.scalar_reward(args.eval_reward_key or args.reward_key) for s in samples]
    out = {
        f"eval/{name}/reward_mean": statistics.fmean(rewards),
        f"eval/{name}/reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
        f"eval/{name}/num_samples": float(len(samples)),
    }
    from miles.rollout.reward_metrics import component_metrics

    out.update({k.replace("/raw_", "/reward_"): v for k, v in component_metrics(f"eval/{name}", samples).items()})
    labelled = [s for s in samples if isinstance(s.metadata.get("label"), int)]
    if labelled and len(labelled) == len(samples):
        from miles.rewards.scorers.digit_metrics import digit_eval_metrics

        # an edit's digit is read where digit_edit reads it: cropped at its source digit's size
        edits = all(s.sources for s in samples)
        metrics = digit_eval_metrics(
            [s.image for s in samples],
            [s.metadata for s in samples],
            _classifier_for(args),
            sources=[s.sources[0] for s in samples] if edits else None,
        )
        out.update({f"eval/{name}/{key}": float(value) for key, value in metrics.items()})
    return out


def _classifier_for(args: Any) -> Any:
    from miles.core.inputs import input_path
    from miles.rewards.scorers.digit import CLASSIFIER_DIRNAME, load_digit_classifier

    own = input_path(args, args.hf_checkpoint) / CLASSIFIER_DIRNAME
    return load_digit_classifier(own if own.is_dir() else None)
