"""Rollout files: one rollout's samples, loadable with `torch.load(weights_only=True)`.

Layout (a `torch.save` of a plain dict):
    {"rollout_id": int | str, "samples": [Sample.to_dict(), ...], "extra": dict | None}
`extra["model"]` (`MODEL_KEY`), when the writer passed `model=`, records what the rollout was made with: the
model family, the checkpoint and its denoiser's shape facts (`miles.models.model_record`); `miles replay`
refuses a file whose record differs from the job's checkpoint. Files written without it still load (nothing to
compare).
Only tensors, numbers, bools, None, strings, lists/tuples and dicts with str keys may appear, so
loading never runs code. Saving anything else is refused with the key path of the offender
(e.g. `samples[3].metadata.foo`). Files are written atomically (temp file + `os.replace`).

`--save-debug-rollout-data` / `--load-debug-rollout-data` are path templates formatted with the
rollout id (`{rollout_id}`, or a positional `{}`); `--load-debug-rollout-data-subsample` keeps a
fraction of a replayed rollout (its first and last halves).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

from miles.core.errors import ConfigError
from miles.core.sample import Sample
from miles.utils.atomic import atomic_open
from miles.utils.text import clip_repr, first_line

T = TypeVar("T")

_ALLOWED = "tensors, numbers, bools, None, strings, lists/tuples and dicts with str keys"
_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
MODEL_KEY = "model"


def _child(where: str, key: str) -> str:
    return f"{where}.{key}" if _IDENT.match(key) else f"{where}[{key!r}]"


def check_serializable(obj: Any, where: str = "value") -> None:
    """Raise ValueError naming the key path of the first value a rollout file may not hold."""
    _check(obj, where, set())


def _check(obj: Any, where: str, active: set[int]) -> None:
    if obj is None or type(obj) in (bool, int, float, str):
        return
    if type(obj) in _TENSOR_TYPES:
        return
    if type(obj) in (list, tuple, dict):
        if id(obj) in active:
            raise ValueError(f"{where}: a reference cycle cannot be saved in a rollout file")
        active.add(id(obj))
        try:
            if type(obj) is dict:
                for key, value in obj.items():
                    if type(key) is not str:
                        raise ValueError(
                            f"{where}: dict key {key!r} is a {type(key).__name__}; rollout files need str keys"
                        )
                    _check(value, _child(where, key), active)
            else:
                for i, value in enumerate(obj):
                    _check(value, f"{where}[{i}]", active)
        finally:
            active.discard(id(obj))
        return
    raise ValueError(f"{where}: cannot save a {type(obj).__module__}.{type(obj).__qualname__} ({_ALLOWED} only)")


def save_rollout(
    path: str | os.PathLike,
    rollout_id: int | str,
    samples: Sequence[Sample | dict[str, Any]],
    extra: dict[str, Any] | None = None,
    *,
    model: Mapping[str, Any] | None = None,
) -> Path:
    """Write one rollout to `path` atomically; returns the path. `model` (`model_record_of(args)`) is kept as
    `extra["model"]`, what replay checks the job's checkpoint against."""
    path = Path(path)
    if model is not None:
        extra = {**(extra or {}), MODEL_KEY: dict(model)}
    rows = [sample.to_dict() if isinstance(sample, Sample) else sample for sample in samples]
    payload = {"rollout_id": rollout_id, "samples": rows, "extra": extra}
    check_serializable(rollout_id, "rollout_id")
    if type(rollout_id) not in (int, str):
        raise ValueError(f"rollout_id: expected an int or str, got {type(rollout_id).__name__}")
    for i, row in enumerate(rows):
        if type(row) is not dict:
            raise ValueError(f"samples[{i}]: expected a Sample or a dict, got {type(row).__name__}")
        check_serializable(row, f"samples[{i}]")
    if extra is not None and type(extra) is not dict:
        raise ValueError(f"extra: expected a dict or None, got {type(extra).__name__}")
    check_serializable(extra, "extra")

    with atomic_open(path, "wb") as handle:
        torch.save(payload, handle)
    return path


def _forbidden_global(message: str) -> str | None:
    match = re.search(r"Unsupported global: GLOBAL ([\w.]+)", message)
    if match:
        return match.group(1)
    match = re.search(r"Unsupported operand (\d+)", message)
    return f"pickle operand {match.group(1)}" if match else None


def load_rollout(path: str | os.PathLike) -> tuple[int | str, list[Sample], dict[str, Any] | None]:
    """Read a rollout file: `(rollout_id, samples, extra)`. Every problem is a one-line ConfigError."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"rollout file not found: {path}")
    try:
        payload = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:
        import pickle

        if isinstance(exc, pickle.UnpicklingError) and "weights only" in str(exc).lower():
            culprit = _forbidden_global(str(exc))
            detail = f" ({culprit})" if culprit else ""
            raise ConfigError(
                f"{path}: holds an object a rollout file may not contain{detail}; only {_ALLOWED} load safely"
            ) from None
        first = first_line(exc)
        raise ConfigError(f"{path}: not a rollout file (cannot read it: {type(exc).__name__}: {first})") from None
    if not isinstance(payload, dict) or "rollout_id" not in payload or not isinstance(payload.get("samples"), list):
        raise ConfigError(f"{path}: not a rollout file (expected a dict with 'rollout_id' and a 'samples' list)")
    rollout_id = payload["rollout_id"]
    if isinstance(rollout_id, bool) or not isinstance(rollout_id, (int, str)) or len(str(rollout_id)) > 200:
        raise ConfigError(f"{path}: 'rollout_id' must be an int or a short name, got {clip_repr(rollout_id, 60)}")
    samples: list[Sample] = []
    for i, row in enumerate(payload["samples"]):
        if not isinstance(row, dict):
            raise ConfigError(f"{path}: samples[{i}] is a {type(row).__name__}, not a sample dict")
        try:
            samples.append(Sample.from_dict(row))
        except (TypeError, ValueError, KeyError) as exc:
            first = first_line(exc)
            raise ConfigError(f"{path}: samples[{i}] is not a sample ({first})") from None
    extra = payload.get("extra")
    if extra is not None and not isinstance(extra, dict):
        raise ConfigError(f"{path}: 'extra' is a {type(extra).__name__}, not a dict")
    return payload["rollout_id"], samples, extra


def format_rollout_path(template: str | os.PathLike, rollout_id: int | str) -> Path:
    """Fill a `--save/--load-debug-rollout-data` template: `{rollout_id}` or a positional `{}`."""
    text = str(template)
    try:
        return Path(text.format(rollout_id, rollout_id=rollout_id))
    except (KeyError, IndexError, ValueError) as exc:
        raise ConfigError(
            f"path template {text!r}: use {{rollout_id}} (or {{}}) as the only placeholder ({type(exc).__name__}: "
            f"{exc})"
        ) from None


def subsample_rollout(rows: Sequence[T], ratio: float | None, *, group_size: int = 1) -> list[T]:
    """`--load-debug-rollout-data-subsample`: keep `int(len * ratio)` rows, the first half and the last half.

    With `group_size > 1` the rows are cut into consecutive groups first and whole groups are kept
    (so prompt groups stay complete). `ratio=None` keeps everything.
    """
    rows = list(rows)
    if ratio is None:
        return rows
    if not 0 < ratio <= 1:
        raise ConfigError(f"--load-debug-rollout-data-subsample must be in (0, 1], got {ratio}")
    if group_size < 1 or len(rows) % group_size != 0:
        raise ValueError(f"{len(rows)} rows do not split into groups of {group_size}")
    units = [rows[i : i + group_size] for i in range(0, len(rows), group_size)]
    keep = int(len(units) * ratio)
    if keep == 0:
        raise ConfigError(
            f"--load-debug-rollout-data-subsample {ratio} keeps none of the {len(units)} "
            f"{'groups' if group_size > 1 else 'samples'} of the rollout"
        )
    head = keep // 2
    chosen = units[:head] + units[len(units) - (keep - head) :]
    return [row for unit in chosen for row in unit]


def rollout_model(extra: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The model record a rollout file was written with (`extra["model"]`), or None for an older file."""
    record = (extra or {}).get(MODEL_KEY)
    return record if isinstance(record, dict) else None
