"""Checkpoints (`--save` / `--load` / `--ckpt-step`).

Layout (every iteration is kept):

    <save>/latest_checkpointed_iteration.txt      the step of the newest complete checkpoint
    <save>/iter_{step:07d}/<name>                 one file per part: torch.save'd objects (model.pt, optimizer.pt,
                                                  rng.pt, lr_scheduler.pt, ema.pt, ...) and JSON ones (extra.json)
    <save>/iter_{step:07d}/manifest.json          every part's size and CRC-32

A save writes every part and the manifest into a hidden temp folder next to the target (`.iter_{step:07d}.tmp-*`),
fsyncs it, renames it into place and only then rewrites the pointer file atomically. A crash at any point leaves the
previous checkpoint loadable: the pointer never names a half-written folder, and loading never reads the hidden temp
ones. A file damaged later (a truncated copy, a flipped byte) is caught against the manifest at load, and the latest
checkpoint falls back to the newest earlier complete one (`checkpoint_index.find_loadable_checkpoint`). The layout
logic that needs no torch lives in `checkpoint_index` (the preflight reads it); it is re-exported here.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from miles.core.errors import ConfigError
from miles.training.checkpoint_index import (
    LATEST_FILE,
    MANIFEST_FILE,
    LoadChoice,
    available_steps,
    find_loadable_checkpoint,
    iter_dir_name,
    read_latest_step,
    resolve_checkpoint_dir,
    where_named,
    write_manifest,
)
from miles.utils.atomic import atomic_write_text
from miles.utils.disk import writing

__all__ = [
    "LATEST_FILE",
    "MANIFEST_FILE",
    "LoadChoice",
    "available_steps",
    "find_loadable_checkpoint",
    "iter_dir_name",
    "load_checkpoint",
    "read_checkpoint",
    "read_latest_step",
    "resolve_checkpoint_dir",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
]


def _fsync_dir(path: Path) -> None:
    # Directory fsync makes renames durable; not every platform/filesystem allows it.
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _check_name(name: str, *, json_part: bool) -> None:
    if not name or name in (".", "..") or "/" in name or "\\" in name or name in (LATEST_FILE, MANIFEST_FILE):
        raise ValueError(f"checkpoint part name {name!r} must be a plain file name")
    if json_part != name.endswith(".json"):
        kind = "json_parts" if json_part else "parts"
        raise ValueError(f"checkpoint {kind} name {name!r}: JSON parts, and only they, end in .json")


def save_checkpoint(
    save_dir: str | os.PathLike,
    step: int,
    parts: dict[str, Any],
    json_parts: dict[str, Any] | None = None,
) -> Path:
    """Write `<save_dir>/iter_{step:07d}/` with `parts` (name -> object, torch.save) and `json_parts`
    (name ending in .json -> JSON-serialisable object), then point `latest_checkpointed_iteration.txt` at it.
    Re-saving an existing step replaces that folder. Returns the checkpoint folder."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"checkpoint step must be an int >= 0, got {step!r}")
    json_parts = json_parts or {}
    for name in parts:
        _check_name(name, json_part=False)
    for name in json_parts:
        _check_name(name, json_part=True)
    root = Path(save_dir)
    if root.exists() and not root.is_dir():
        raise ConfigError(f"--save {root}: exists and is not a directory")
    root.mkdir(parents=True, exist_ok=True)
    final = root / iter_dir_name(step)

    with writing(final):  # out of space: one DiskFull naming the checkpoint; the latest stays the last whole one
        return _write_checkpoint(root, final, step, parts, json_parts)


def _write_checkpoint(root: Path, final: Path, step: int, parts: dict[str, Any], json_parts: dict[str, Any]) -> Path:
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
    trash: Path | None = None
    try:
        for name, obj in parts.items():
            with open(tmp / name, "wb") as handle:
                torch.save(obj, handle)
                handle.flush()
                os.fsync(handle.fileno())
        for name, obj in json_parts.items():
            with open(tmp / name, "w", encoding="utf-8") as handle:
                json.dump(obj, handle, indent=2, sort_keys=True)
                handle.write("\n")
                handle.flush()
                os.fsync(handle.fileno())
        write_manifest(tmp, [*parts, *json_parts])
        _fsync_dir(tmp)
        if final.exists():
            trash = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=root))
            os.replace(final, trash / final.name)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if trash is not None and not final.exists() and (trash / final.name).is_dir():
            os.replace(trash / final.name, final)  # put the replaced checkpoint back
            shutil.rmtree(trash, ignore_errors=True)
        raise
    _fsync_dir(root)
    atomic_write_text(root / LATEST_FILE, f"{step}\n")
    _fsync_dir(root)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)
    return final


def load_checkpoint(
    load_dir: str | os.PathLike,
    ckpt_step: int | None = None,
    parts: Iterable[str] | None = None,
    *,
    map_location: Any = "cpu",
    weights_only: bool = True,
) -> tuple[int, dict[str, Any]]:
    """Read a checkpoint: the one `ckpt_step` names, else the one `latest_checkpointed_iteration.txt` names (or,
    when that one is damaged, the newest earlier complete one; the warning goes to stderr). See `read_checkpoint`.
    Returns (step, {name: object})."""
    choice, loaded = read_checkpoint(load_dir, ckpt_step, parts, map_location=map_location, weights_only=weights_only)
    for warning in choice.warnings:
        print(f"miles: warning: {warning}", file=sys.stderr, flush=True)
    return choice.step, loaded


def read_checkpoint(
    load_dir: str | os.PathLike,
    ckpt_step: int | None = None,
    parts: Iterable[str] | None = None,
    *,
    map_location: Any = "cpu",
    weights_only: bool = True,
    where: str | None = None,
) -> tuple[LoadChoice, dict[str, Any]]:
    """(the checkpoint chosen, with its warnings; {name: object}).

    The choice is `find_loadable_checkpoint(load_dir, ckpt_step, verify="full")`: every file is checked against
    the manifest's size and checksum before it is read. `parts` picks files by name (ConfigError if one is absent,
    e.g. optimizer.pt after `--no-save-optim`); None reads them all. `.json` files are parsed as JSON, the rest go
    through torch.load (weights_only by default: tensors, containers and plain values, which is all this package
    saves). A file that does not load (a checkpoint saved before manifests, damaged) is a ConfigError naming it.
    `where`: how messages name the folder (default `--load DIR`)."""
    choice = find_loadable_checkpoint(load_dir, ckpt_step, verify="full", where=where)
    folder = choice.path
    if parts is None:
        names = sorted(entry.name for entry in folder.iterdir() if entry.is_file() and entry.name != MANIFEST_FILE)
    else:
        names = list(parts)
        missing = [name for name in names if not (folder / name).is_file()]
        if missing:
            present = sorted(entry.name for entry in folder.iterdir() if entry.name != MANIFEST_FILE)
            raise ConfigError(
                f"checkpoint {folder} has no {', '.join(missing)} (it holds: {', '.join(present) or 'nothing'}); "
                "a checkpoint saved with --no-save-optim needs --no-load-optim"
            )
    loaded: dict[str, Any] = {}
    for name in names:
        path = folder / name
        try:
            if name.endswith(".json"):
                loaded[name] = json.loads(path.read_text(encoding="utf-8"))
            else:
                loaded[name] = torch.load(path, map_location=map_location, weights_only=weights_only)
        except Exception as exc:  # any failure to read a part is one line naming the file
            raise ConfigError(
                f"{where_named(load_dir, where)}: cannot read {folder.name}/{name} ({_one_line(exc)}); the file is "
                "damaged or not a miles checkpoint part "
                f"(available steps: {', '.join(map(str, available_steps(load_dir)))})"
            ) from None
    return choice, loaded


def _one_line(exc: BaseException, limit: int = 200) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---- RNG state -------------------------------------------------------------------------------------------


def rng_state() -> dict[str, Any]:
    """The state of python's `random`, numpy's global RNG, torch's CPU generator and, when CUDA is up, every
    CUDA device's generator. Only tensors and plain values, so it loads with `weights_only=True`."""
    np_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "key": torch.from_numpy(np.asarray(np_state["state"]["key"], dtype=np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
        "cuda": None,
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` captured. CUDA states are restored for the devices present (a checkpoint from a
    CPU run leaves the CUDA generators alone)."""
    if state.get("python") is not None:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if state.get("numpy") is not None:
        np_state = state["numpy"]
        np.random.set_state(
            {
                "bit_generator": np_state["bit_generator"],
                "state": {
                    "key": np.asarray(np_state["key"], dtype=np.int64).astype(np.uint32),
                    "pos": np_state["pos"],
                },
                "has_gauss": np_state["has_gauss"],
                "gauss": np_state["gauss"],
            }
        )
    if state.get("torch") is not None:
        torch.set_rng_state(state["torch"])
    cuda_states = state.get("cuda")
    if cuda_states and torch.cuda.is_available():
        for index, cuda_state in enumerate(cuda_states[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, device=index)
