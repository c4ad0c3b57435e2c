"""Prompt data sources: the global data set with per-epoch shuffling, and the buffer.

Prompt data (JSONL, one object per line; or a `.txt`, `.parquet` or `datasets` folder, `miles.data.formats`), read
by the streaming reader of `miles.data.prompts` (re-exported here: `iter_jsonl_objects`, `load_prompts`,
`PromptRecord`):
    {"input": "a photo of a cat", "metadata": {"rm_type": "ocr"}}
`--input-key` names the prompt (a required, non-empty string); `--metadata-key` names an optional dict,
`--media-key` an optional list of condition media (`miles.data.media`).
`--prompt-data` is a file path or a built-in data set name such as `digits:train`.

`get_samples(num_prompts)` returns `num_prompts` groups; a group is one prompt repeated
`n_samples_per_prompt` times. `group_index` counts groups over the whole run (it survives epochs and
resume), `index` is the sample's position in the returned batch, and `seed` follows the documented
layout of `miles.sampling.seeds` (`seed_base(group_index) + j` for the j-th sample of a group).

The order of the prompts is a fresh permutation every epoch, drawn from `(--seed, epoch)`, so it is
deterministic, differs between epochs, and is reproduced exactly after `load_state_dict`.

`--data-source-path` swaps the class (`__init__(args)`, `get_samples(num_samples)`,
`add_samples(groups)`, `save(...)`, `load(...)`); the default is `RolloutDataSourceWithBuffer`.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from miles.core.errors import ConfigError
from miles.core.sample import Sample
from miles.data.prompt_file import MAX_LINE_BYTES as MAX_LINE_BYTES
from miles.data.prompt_file import PromptKeys
from miles.data.prompt_file import iter_jsonl_objects as iter_jsonl_objects
from miles.data.prompts import PromptRecord as PromptRecord
from miles.data.prompts import load_prompts as load_prompts
from miles.sampling.seeds import group_sample_seeds
from miles.utils.atomic import atomic_write_text
from miles.utils.hooks import load_class, load_function

logger = logging.getLogger(__name__)

STATE_VERSION = 1


def resolve_prompt_data(args: Any, spec: str | os.PathLike) -> Path:
    """The file behind `--prompt-data` (or an eval set): the path a built-in name was resolved to
    (`args.inputs`), or the path given."""
    from miles.core.inputs import input_path

    path = input_path(args, spec)
    assert path is not None
    return path


def num_rollout_for(args: Any, dataset_size: int) -> int:
    """`--num-rollout` when set, else `num_epoch (default 1) * ceil(dataset_size / rollout_batch_size)`."""
    num_rollout = args.num_rollout
    if num_rollout is not None:
        return int(num_rollout)
    batch = args.rollout_batch_size
    if not batch or batch < 1:
        raise ConfigError("--rollout-batch-size is required to derive --num-rollout from the data set")
    if dataset_size < 1:
        raise ConfigError("cannot derive --num-rollout: the prompt data set is empty")
    num_epoch = args.num_epoch or 1
    return int(num_epoch) * math.ceil(dataset_size / int(batch))


def epoch_permutation(size: int, seed: int, epoch: int) -> list[int]:
    """The prompt order of `epoch`: a permutation of range(size) drawn from (seed, epoch)."""
    rng = np.random.default_rng([int(seed) & 0xFFFFFFFFFFFFFFFF, int(epoch)])
    return rng.permutation(size).tolist()


def _write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


class RolloutDataSource:
    """The global prompt data set, served in groups of `n_samples_per_prompt`, shuffled per epoch."""

    def __init__(self, args: Any) -> None:
        self.args = args
        self.n_samples_per_prompt = int(args.n_samples_per_prompt or 1)
        self.seed = int(args.seed)
        self.rollout_seed = int(args.rollout_seed)
        self.epoch = 0  # the epoch the next prompt is drawn from
        self.offset = 0  # prompts already served from the current epoch
        self.group_counter = 0  # the group_index of the next group
        self.path: Path | None = None
        self.dataset: list[PromptRecord] | None = None
        self._order: list[int] | None = None
        self._order_epoch: int | None = None

        spec = args.prompt_data
        if spec is not None and not args.disable_rollout_global_dataset:
            self.path = resolve_prompt_data(args, spec)
            self.dataset = load_prompts(self.path, PromptKeys.of(args))

    def __len__(self) -> int:
        return len(self.dataset) if self.dataset is not None else 0

    def num_rollout(self) -> int:
        return num_rollout_for(self.args, len(self))

    def _epoch_order(self) -> list[int]:
        if self._order is None or self._order_epoch != self.epoch:
            self._order = epoch_permutation(len(self), self.seed, self.epoch)
            self._order_epoch = self.epoch
        return self._order

    def _next_records(self, num_prompts: int) -> list[PromptRecord]:
        if self.dataset is None:
            raise ConfigError(
                "the data source has no global data set (--prompt-data unset or --disable-rollout-global-dataset);"
                " a custom --data-source-path must supply the prompts"
            )
        records = []
        for _ in range(num_prompts):
            if self.offset >= len(self.dataset):
                self.epoch += 1
                self.offset = 0
            records.append(self.dataset[self._epoch_order()[self.offset]])
            self.offset += 1
        return records

    def _make_group(self, record: PromptRecord) -> list[Sample]:
        group_index = self.group_counter
        self.group_counter += 1
        seeds = group_sample_seeds(self.rollout_seed, group_index, self.n_samples_per_prompt)
        return [
            Sample(
                index=0,
                group_index=group_index,
                prompt=record.prompt,
                metadata=copy.deepcopy(record.metadata),
                seed=seed,
                media=tuple(str(m.path) for m in record.media),
            )
            for seed in seeds
        ]

    def get_samples(self, num_samples: int, rollout_id: int | None = None) -> list[list[Sample]]:
        """`num_samples` prompt groups from the data set, starting the next epoch when one runs out."""
        if num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {num_samples}")
        groups = [self._make_group(record) for record in self._next_records(num_samples)]
        reindex(groups)
        return groups

    def add_samples(self, groups: list[list[Sample]]) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no buffer; use RolloutDataSourceWithBuffer")

    # -- resume ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "offset": self.offset,
            "group_counter": self.group_counter,
            "seed": self.seed,
            "dataset_size": len(self),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            epoch, offset, counter = int(state["epoch"]), int(state["offset"]), int(state["group_counter"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"data source state: missing or bad field ({exc})") from None
        if min(epoch, offset, counter) < 0:
            raise ConfigError(f"data source state: negative counters {state}")
        size = state.get("dataset_size")
        if size is not None and self.dataset is not None and int(size) != len(self):
            logger.warning("data source state was saved with %s prompts, the data set now has %s", size, len(self))
        if state.get("seed") is not None and int(state["seed"]) != self.seed:
            logger.warning("data source state was saved with --seed %s, now %s", state["seed"], self.seed)
        self.epoch, self.offset, self.group_counter = epoch, offset, counter
        self._order = None

    def save(self, path: str | os.PathLike) -> None:
        """Write `state_dict()` as JSON to `path` (atomically)."""
        _write_json_atomic(Path(path), self.state_dict())

    def load(self, path: str | os.PathLike) -> None:
        """Restore the state written by `save(path)`."""
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"data source state file not found: {path}")
        try:
            state = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(f"{path}: not a data source state file ({exc})") from None
        if not isinstance(state, dict):
            raise ConfigError(f"{path}: not a data source state file (expected a JSON object)")
        try:
            self.load_state_dict(state)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None


BufferFilter = Callable[[Any, "int | None", list[list[Sample]], int], list[list[Sample]]]


def pop_first(args: Any, rollout_id: int | None, buffer: list[list[Sample]], num_samples: int) -> list[list[Sample]]:
    """The default buffer filter: take (and remove) the oldest `num_samples` groups."""
    taken = buffer[:num_samples]
    del buffer[:num_samples]
    return taken


def reindex(groups: Sequence[Sequence[Sample]]) -> None:
    """Set every sample's `index` to its position in the flattened batch."""
    position = 0
    for group in groups:
        for sample in group:
            sample.index = position
            position += 1


class RolloutDataSourceWithBuffer(RolloutDataSource):
    """The default data source: groups put back with `add_samples` are served first (`--buffer-filter-path`)."""

    def __init__(self, args: Any) -> None:
        super().__init__(args)
        self.buffer: list[list[Sample]] = []
        path = args.buffer_filter_path
        self.buffer_filter: BufferFilter = load_function(path, "--buffer-filter-path") if path else pop_first

    def get_buffer_length(self) -> int:
        return len(self.buffer)

    def add_samples(self, groups: list[list[Sample]]) -> None:
        """Put whole groups back; they are served before new prompts."""
        if not isinstance(groups, list):
            raise TypeError(f"add_samples expects a list of groups, got {type(groups).__name__}")
        for i, group in enumerate(groups):
            if not isinstance(group, list) or not all(isinstance(s, Sample) for s in group):
                raise TypeError(f"add_samples: group {i} is not a list of Sample")
            if len(group) != self.n_samples_per_prompt:
                raise ValueError(
                    f"add_samples: group {i} has {len(group)} samples, expected n_samples_per_prompt="
                    f"{self.n_samples_per_prompt}"
                )
        self.buffer.extend(groups)

    def get_samples(self, num_samples: int, rollout_id: int | None = None) -> list[list[Sample]]:
        if num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {num_samples}")
        groups: list[list[Sample]] = []
        if self.buffer and num_samples > 0:
            groups = list(self.buffer_filter(self.args, rollout_id, self.buffer, num_samples))
            if len(groups) > num_samples:
                raise ValueError(
                    f"--buffer-filter-path returned {len(groups)} groups, more than the {num_samples} asked for"
                )
        if len(groups) < num_samples:
            groups += super().get_samples(num_samples - len(groups), rollout_id)
        reindex(groups)
        return groups

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self.buffer:  # samples hold tensors; the buffer is not part of the resumable state
            logger.warning("data source state: %d buffered groups are not saved", len(self.buffer))
        return state


def load_data_source(args: Any) -> RolloutDataSource:
    """The data source of a job: the `--data-source-path` class, else `RolloutDataSourceWithBuffer`."""
    path = args.data_source_path
    cls = load_class(path, "--data-source-path") if path else RolloutDataSourceWithBuffer
    return cls(args)
