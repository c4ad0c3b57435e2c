"""Counts for a checkpoint's configs, measured once: the `counts.json` shipped next to a family's real configs,
else `$MILES_HOME/memory/<config hash>.json`, else a meta-device build (`measure`, seconds) written there.

A cached record is used when its config hash and its diffusers / transformers / peft versions are today's (a
library upgrade may change a module's tensors) and it holds the LoRA target sets and FSDP2 groups asked for; what
is missing is measured and merged. The shipped `counts.json` is used whatever the installed versions (its config
hash must match): a registry release must not make `miles plan` measure, and tests/memory/test_memory_real_configs
re-measures it against the installed libraries. Torch is imported only to measure.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from miles.memory.config_dirs import COUNTS_FILE, config_hash
from miles.memory.counts import ModelCounts, fsdp_key, library_versions, lora_key
from miles.utils.paths import file_lock, miles_home

VERSION_KEYS = ("diffusers", "transformers", "peft")


def cache_dir() -> Path:
    return miles_home() / "memory"


def cache_path(digest: str) -> Path:
    return cache_dir() / f"{digest}.json"


def _read(path: Path) -> ModelCounts | None:
    try:
        with open(path) as f:
            return ModelCounts.from_json(json.load(f))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _current(counts: ModelCounts | None, digest: str) -> bool:
    if counts is None or counts.config_hash != digest:
        return False
    today = library_versions()
    return all(counts.versions.get(k) == today.get(k) for k in VERSION_KEYS)


def _write(path: Path, counts: ModelCounts) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(counts.dumps())
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def _shipped(config_dir: Path, digest: str) -> ModelCounts | None:
    counts = _read(config_dir / COUNTS_FILE)
    return counts if counts is not None and counts.config_hash == digest else None


def _records(config_dir: Path, digest: str) -> list[ModelCounts]:
    cached = _read(cache_path(digest))
    return [c for c in (_shipped(config_dir, digest), cached if _current(cached, digest) else None) if c is not None]


def cached_counts(config_dir: Path) -> ModelCounts | None:
    """The record for `config_dir`, shipped or in the cache with today's versions (None: to be measured)."""
    digest = config_hash(config_dir)
    records = _records(config_dir, digest)
    return records[0] if records else None


def _merged(records: list[ModelCounts]) -> ModelCounts:
    base = records[0]
    for other in records[1:]:
        base.lora.update({k: v for k, v in other.lora.items() if k not in base.lora})
        base.fsdp.update({k: v for k, v in other.fsdp.items() if k not in base.fsdp})
    return base


def model_counts(
    config_dir: Path,
    family: Any,
    components: tuple[str, ...],
    targets_sets: Iterable[tuple[str, ...]] = (),
) -> ModelCounts:
    """The counts of `config_dir` with the denoiser of `components`' FSDP2 groups and LoRA pairs for each target set
    (e.g. `family.denoiser_components(...)` and the job's `--lora-target-modules`)."""
    digest = config_hash(config_dir)
    wanted = [tuple(t) for t in targets_sets]
    records = _records(config_dir, digest)
    if records:
        have = _merged(records)
        missing = [t for t in wanted if lora_key(components, t) not in have.lora]
        if not missing and fsdp_key(components, family.fsdp_block_lists) in have.fsdp:
            return have
    with file_lock(cache_dir() / f".{digest}.lock"):
        records = _records(config_dir, digest)
        from miles.memory.measure import measure, measure_denoiser

        if records:
            have = _merged(records)
            missing = [t for t in wanted if lora_key(components, t) not in have.lora]
            lora, fsdp = measure_denoiser(config_dir, family, components, missing, family.fsdp_block_lists)
            have.lora.update(lora)
            have.fsdp.update(fsdp)
        else:
            have = measure(config_dir, family, components, wanted)
        _write(cache_path(digest), have)
    return have


def write_counts(path: Path, counts: ModelCounts) -> None:
    """Write a counts record (e.g. the shipped `counts.json` next to a family's real configs)."""
    _write(path, counts)
