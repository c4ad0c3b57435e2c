"""Eval datasets: pure generation (ODE, `--diffusion-eval-num-steps`), scored, with digit metrics.

Datasets come from `--eval-prompt-data NAME PATH` (repeatable) or `--eval-config` (a YAML/JSON file
`{datasets: [{name, path, n_samples_per_eval_prompt?, num_steps?}]}`). Metrics are reported as
`eval/<name>/<metric>`: `reward_mean` (and `reward_std`) always; for prompts whose metadata holds a
digit `label`, also `accuracy` (the digit classifier agrees with the prompt) and `fd` (Fréchet
distance of classifier features against the real digits test split); for video samples both are per
frame, and prompts whose metadata also holds a `direction` add `direction_acc` (the share of videos whose
digit travels that way; `miles.rollout.rm_hub.digit_metrics.digit_eval_metrics`).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles.config.errors import ConfigError
from miles.rollout.data_source import load_prompt_jsonl, resolve_prompt_data
from miles.rollout.seeds import group_sample_seeds
from miles.rollout.types import Sample

EVAL_SEED_OFFSET = 1_000_003  # eval seeds never collide with the training layout's first groups


@dataclass(frozen=True)
class EvalDataset:
    name: str
    path: str
    n_samples_per_prompt: int
    num_steps: int | None = None


def eval_datasets(args: Any) -> list[EvalDataset]:
    n = int(args.n_samples_per_eval_prompt or 1)
    if args.eval_config:
        from miles.config.layering import load_config_file

        path = Path(args.eval_config)
        data = load_config_file(path, f"--eval-config {path}").data  # strict: a key given twice is refused
        rows = data.get("datasets")
        if not isinstance(rows, list) or not rows:
            raise ConfigError(f"--eval-config {path}: expected a mapping with a non-empty 'datasets' list")
        out = []
        for i, row in enumerate(rows):
            if not isinstance(row, dict) or "name" not in row or "path" not in row:
                raise ConfigError(f"--eval-config {path}: datasets[{i}] needs 'name' and 'path'")
            where = f"--eval-config {path}: datasets[{i}]"
            out.append(
                EvalDataset(
                    str(row["name"]),
                    str(row["path"]),
                    _positive_int(row.get("n_samples_per_eval_prompt", n), f"{where}.n_samples_per_eval_prompt"),
                    None if row.get("num_steps") is None else _positive_int(row["num_steps"], f"{where}.num_steps"),
                )
            )
        return out
    return [EvalDataset(name, spec, n) for name, spec in (args.eval_prompt_data or {}).items()]


def _positive_int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where}: expected an integer >= 1, got {value!r}")
    return value


def eval_groups(args: Any, dataset: EvalDataset) -> list[list[Sample]]:
    key = args.eval_input_key or args.input_key
    records = load_prompt_jsonl(resolve_prompt_data(dataset.path), key, args.metadata_key)
    groups, index = [], 0
    n = dataset.n_samples_per_prompt
    for g, record in enumerate(records):
        seeds = group_sample_seeds(args.rollout_seed + EVAL_SEED_OFFSET, g, n)
        group = []
        for seed in seeds:
            group.append(
                Sample(index=index, group_index=g, prompt=record.prompt, metadata=dict(record.metadata), seed=seed)
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
    labelled = [s for s in samples if isinstance(s.metadata.get("label"), int)]
    if labelled and len(labelled) == len(samples):
        from miles.rollout.rm_hub.digit_metrics import digit_eval_metrics

        metrics = digit_eval_metrics([s.image for s in samples], [s.metadata for s in samples], _classifier_for(args))
        out.update({f"eval/{name}/{key}": float(value) for key, value in metrics.items()})
    return out


def _classifier_for(args: Any) -> Any:
    from miles.models.checkpoints import ensure_checkpoint
    from miles.rollout.rm_hub.digit import CLASSIFIER_DIRNAME, load_digit_classifier

    own = ensure_checkpoint(args.hf_checkpoint) / CLASSIFIER_DIRNAME
    return load_digit_classifier(own if own.is_dir() else None)
