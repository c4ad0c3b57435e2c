"""Checkpoints (`--save` / `--load` / `--ckpt-step`).

Layout (every iteration is kept):

    <save>/latest_checkpointed_iteration.txt      the step of the newest complete checkpoint
    <save>/iter_{step:07d}/<name>                 one file per part: torch.save'd objects (model.pt, optimizer.pt,
                                                  rng.pt, lr_scheduler.pt, ema.pt, ...) and JSON ones (extra.json)

A save writes every part into a hidden temp folder next to the target (`.iter_{step:07d}.tmp-*`), fsyncs it,
renames it into place and only then rewrites the pointer file atomically. A crash at any point leaves the previous
checkpoint loadable: the pointer never names a half-written folder, and loading never reads the hidden temp ones.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from miles.config.errors import ConfigError
from miles.utils.atomic import atomic_write_text

LATEST_FILE = "latest_checkpointed_iteration.txt"
_ITER_RE = re.compile(r"^iter_(\d{7,})$")


def iter_dir_name(step: int) -> str:
    return f"iter_{step:07d}"


def available_steps(ckpt_dir: str | os.PathLike) -> list[int]:
    """The steps of the complete checkpoints under `ckpt_dir`, ascending."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return []
    steps = []
    for entry in root.iterdir():
        match = _ITER_RE.match(entry.name)
        if match and entry.is_dir():
            steps.append(int(match.group(1)))
    return sorted(steps)


def _fsync_dir(path: Path) -> None:
    # Directory fsync makes renames durable; not every platform/filesystem allows it.
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _check_name(name: str, *, json_part: bool) -> None:
    if not name or name in (".", "..") or "/" in name or "\\" in name or name == LATEST_FILE:
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


def read_latest_step(load_dir: str | os.PathLike) -> int | None:
    """The step in `latest_checkpointed_iteration.txt`, or None when the file is absent."""
    pointer = Path(load_dir) / LATEST_FILE
    if not pointer.is_file():
        return None
    text = pointer.read_text(encoding="utf-8").strip()
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"--load {load_dir}: {LATEST_FILE} holds {text!r}, not a step number") from None


def _show_steps(steps: list[int]) -> str:
    return ", ".join(map(str, steps)) if steps else "none"


def resolve_checkpoint_dir(load_dir: str | os.PathLike, ckpt_step: int | None = None) -> tuple[int, Path]:
    """(step, folder) of the checkpoint that `--load`/`--ckpt-step` name; ConfigError if there is none."""
    root = Path(load_dir)
    if not root.is_dir():
        raise ConfigError(f"--load {root}: no such checkpoint directory")
    steps = available_steps(root)
    if ckpt_step is None:
        step = read_latest_step(root)
        if step is None:
            raise ConfigError(
                f"--load {root}: no {LATEST_FILE} (not a checkpoint directory, or no save finished); "
                f"pass --ckpt-step to pick one (available steps: {_show_steps(steps)})"
            )
        folder = root / iter_dir_name(step)
        if not folder.is_dir():
            raise ConfigError(
                f"--load {root}: {LATEST_FILE} names step {step} but {folder.name} is missing; "
                f"pass --ckpt-step (available steps: {_show_steps(steps)})"
            )
        return step, folder
    folder = root / iter_dir_name(ckpt_step)
    if not folder.is_dir():
        raise ConfigError(
            f"--ckpt-step {ckpt_step}: no {folder.name} under --load {root} (available steps: {_show_steps(steps)})"
        )
    return ckpt_step, folder


def load_checkpoint(
    load_dir: str | os.PathLike,
    ckpt_step: int | None = None,
    parts: Iterable[str] | None = None,
    *,
    map_location: Any = "cpu",
    weights_only: bool = True,
) -> tuple[int, dict[str, Any]]:
    """Read a checkpoint: the one `ckpt_step` names, else the one `latest_checkpointed_iteration.txt` names.

    `parts` picks files by name (ConfigError if one is absent, e.g. optimizer.pt after `--no-save-optim`);
    None reads them all. `.json` files are parsed as JSON, the rest go through torch.load (weights_only by
    default: tensors, containers and plain values, which is all this package saves).
    Returns (step, {name: object})."""
    step, folder = resolve_checkpoint_dir(load_dir, ckpt_step)
    if parts is None:
        names = sorted(entry.name for entry in folder.iterdir() if entry.is_file())
    else:
        names = list(parts)
        missing = [name for name in names if not (folder / name).is_file()]
        if missing:
            present = sorted(entry.name for entry in folder.iterdir())
            raise ConfigError(
                f"checkpoint {folder} has no {', '.join(missing)} (it holds: {', '.join(present) or 'nothing'}); "
                "a checkpoint saved with --no-save-optim needs --no-load-optim"
            )
    loaded: dict[str, Any] = {}
    for name in names:
        path = folder / name
        if name.endswith(".json"):
            loaded[name] = json.loads(path.read_text(encoding="utf-8"))
        else:
            loaded[name] = torch.load(path, map_location=map_location, weights_only=weights_only)
    return step, loaded


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
