"""The checkpoint layout, read without torch: which steps exist, which one `--load` names, whether it is whole.

    <load>/latest_checkpointed_iteration.txt      the step of the newest complete checkpoint
    <load>/iter_{step:07d}/manifest.json          every other file's size and CRC-32 (written at save)

`find_loadable_checkpoint` picks the checkpoint a job resumes from: the one `--ckpt-step` names (refused if it is
damaged), else the latest, falling back to the newest earlier complete one with a warning when a file of the latest
is missing, truncated or corrupted. A checkpoint without a manifest (saved before manifests existed) is taken as
it is. The preflight calls it with size verification (a stat per file); `load_checkpoint` with full verification.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from miles.core.errors import ConfigError

LATEST_FILE = "latest_checkpointed_iteration.txt"
MANIFEST_FILE = "manifest.json"
MANIFEST_VERSION = 1
CHECKSUM = "crc32"  # zlib.crc32 over 1 MiB blocks: about 4x blake2b's speed, and it catches torn or flipped bytes
_BLOCK = 1 << 20
_ITER_RE = re.compile(r"^iter_(\d{7,})$")

Verify = Literal["size", "full"]


@dataclass
class LoadChoice:
    """The checkpoint a job loads: its step, its folder and what was wrong with the ones passed over."""

    step: int
    path: Path
    warnings: list[str] = field(default_factory=list)


def iter_dir_name(step: int) -> str:
    return f"iter_{step:07d}"


def available_steps(ckpt_dir: str | os.PathLike) -> list[int]:
    """The steps of the checkpoint folders under `ckpt_dir`, ascending (hidden temp folders excluded)."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return []
    steps = []
    for entry in root.iterdir():
        match = _ITER_RE.match(entry.name)
        if match and entry.is_dir():
            steps.append(int(match.group(1)))
    return sorted(steps)


def where_named(load_dir: str | os.PathLike, where: str | None) -> str:
    """How messages name the folder: `--load DIR` for a job; a command reading a folder given otherwise says so."""
    return where if where is not None else f"--load {load_dir}"


def read_latest_step(load_dir: str | os.PathLike, *, where: str | None = None) -> int | None:
    """The step in `latest_checkpointed_iteration.txt`, or None when the file is absent (`where`: how messages name
    the folder, default `--load DIR`)."""
    pointer = Path(load_dir) / LATEST_FILE
    if not pointer.is_file():
        return None
    text = pointer.read_text(encoding="utf-8", errors="replace").strip()
    try:
        return int(text)
    except ValueError:
        raise ConfigError(
            f"{where_named(load_dir, where)}: {LATEST_FILE} holds {text[:40]!r}, not a step number"
        ) from None


def _show_steps(steps: list[int]) -> str:
    return ", ".join(map(str, steps)) if steps else "none"


def resolve_checkpoint_dir(
    load_dir: str | os.PathLike, ckpt_step: int | None = None, *, where: str | None = None
) -> tuple[int, Path]:
    """(step, folder) of the checkpoint that `--load`/`--ckpt-step` name (not verified); ConfigError if none."""
    root = Path(load_dir)
    named = where_named(root, where)
    if not root.is_dir():
        raise ConfigError(f"{named}: no such checkpoint directory")
    steps = available_steps(root)
    if ckpt_step is None:
        step = read_latest_step(root, where=where)
        if step is None:
            raise ConfigError(
                f"{named}: no {LATEST_FILE} (not a checkpoint directory, or no save finished); "
                f"pass --ckpt-step to pick one (available steps: {_show_steps(steps)})"
            )
        folder = root / iter_dir_name(step)
        if not folder.is_dir():
            raise ConfigError(
                f"{named}: {LATEST_FILE} names step {step} but {folder.name} is missing; "
                f"pass --ckpt-step (available steps: {_show_steps(steps)})"
            )
        return step, folder
    folder = root / iter_dir_name(ckpt_step)
    if not folder.is_dir():
        raise ConfigError(
            f"--ckpt-step {ckpt_step}: no {folder.name} under {named} (available steps: {_show_steps(steps)})"
        )
    return ckpt_step, folder


# ---- manifests ---------------------------------------------------------------------------------------------


def file_checksum(path: str | os.PathLike) -> str:
    """CRC-32 of a file, streamed in 1 MiB blocks, as 8 hex digits."""
    crc = 0
    with open(path, "rb") as handle:
        while block := handle.read(_BLOCK):
            crc = zlib.crc32(block, crc)
    return f"{crc:08x}"


def write_manifest(folder: str | os.PathLike, names: Iterable[str]) -> Path:
    """Write `folder/manifest.json` with the size and checksum of each of `names` (files in `folder`), fsynced."""
    folder = Path(folder)
    files = {name: {"size": (folder / name).stat().st_size, CHECKSUM: file_checksum(folder / name)} for name in names}
    path = folder / MANIFEST_FILE
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(
            {"version": MANIFEST_VERSION, "checksum": CHECKSUM, "files": files}, handle, indent=1, sort_keys=True
        )
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())
    return path


def checkpoint_problems(folder: str | os.PathLike, verify: Verify = "size") -> list[str]:
    """What is wrong with the checkpoint in `folder`, one phrase per damaged file ('iter_0000004/model.pt is
    truncated (1,234 of 5,678 bytes)'); [] when it is whole or has no manifest. `verify="size"` stats each file,
    `"full"` also recomputes its checksum."""
    if verify not in ("size", "full"):
        raise ValueError(f"verify must be 'size' or 'full', not {verify!r}")
    folder = Path(folder)
    manifest_path = folder / MANIFEST_FILE
    if not manifest_path.exists():
        return []  # saved before manifests: accepted as it is (a torch.load failure is still named at load)
    where = f"{folder.name}/{MANIFEST_FILE}"
    manifest, problem = read_manifest(manifest_path)
    if problem is not None:
        return [f"{where} {problem}"]
    algorithm = manifest.get("checksum", CHECKSUM)
    problems = []
    for name, entry in sorted(manifest["files"].items()):
        problem = _file_problem(folder, name, entry, verify == "full" and algorithm == CHECKSUM)
        if problem:
            problems.append(problem)
    return problems


def read_manifest(path: Path) -> tuple[dict[str, Any], str | None]:
    """(manifest, None), or ({}, what is wrong with it: 'is unreadable (...)', 'is not a valid manifest (...)'):
    an object whose 'files' maps plain file names to {"size": bytes, "crc32"?: hex}."""
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        return {}, f"is unreadable ({type(exc).__name__})"
    why = _manifest_shape_problem(manifest)
    return (manifest, None) if why is None else ({}, f"is not a valid manifest ({why})")


def _manifest_shape_problem(manifest: Any) -> str | None:
    if not isinstance(manifest, dict):
        return f"{_kind(manifest)}, not an object"
    files = manifest.get("files")
    if not isinstance(files, dict):
        return "no 'files' mapping" if files is None else f"'files' is {_kind(files)}, not a mapping"
    for name, entry in files.items():
        shown = _clip(name)
        if not name or "/" in name or "\\" in name or name in (".", ".."):
            return f"{json.dumps(shown)} is not a file name of the checkpoint folder"
        if not isinstance(entry, dict):
            return f"the entry of {shown} is {_kind(entry)}, not a mapping"
        size = entry.get("size")
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 0):
            return f"the size of {shown} is {_clip(json.dumps(size))}, not a byte count"
        checksum = entry.get(CHECKSUM)
        if checksum is not None and not isinstance(checksum, str):
            return f"the {CHECKSUM} of {shown} is {_clip(json.dumps(checksum))}, not a hex string"
    return None


def _kind(value: Any) -> str:
    """What a JSON value is, for messages: 'a list', 'a number', ..."""
    names = {dict: "an object", list: "a list", str: "a string", bool: "a bool", type(None): "null"}
    return names.get(type(value), "a number" if isinstance(value, (int, float)) else type(value).__name__)


def _clip(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _file_problem(folder: Path, name: str, entry: dict[str, Any], full: bool) -> str | None:
    """What is wrong with one file the manifest lists (None: its size, and with `full` its checksum, match)."""
    path = folder / name
    shown = f"{folder.name}/{name}"
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return f"{shown} is missing"
    except OSError as exc:
        return f"{shown} cannot be read ({exc.strerror})"
    expected = entry.get("size")
    if expected is None:
        return f"{folder.name}/{MANIFEST_FILE} has no size for {name}"
    if size < expected:
        return f"{shown} is truncated ({size:,} of {expected:,} bytes)"
    if size > expected:
        return f"{shown} has {size:,} bytes, not the {expected:,} it was saved with"
    if not full or entry.get(CHECKSUM) is None:
        return None
    try:
        actual = file_checksum(path)
    except OSError as exc:
        return f"{shown} cannot be read ({exc.strerror})"
    if actual != entry[CHECKSUM]:
        return f"{shown} is corrupted (its {CHECKSUM} does not match the one saved with it)"
    return None


def find_loadable_checkpoint(
    load_dir: str | os.PathLike, ckpt_step: int | None = None, verify: Verify = "size", *, where: str | None = None
) -> LoadChoice:
    """The checkpoint `--load load_dir` (and `--ckpt-step`) resumes from, verified against its manifest.

    With `ckpt_step` a damaged checkpoint is refused. Without it the latest one is taken if it is whole; else the
    newest earlier whole one, with a warning naming the damaged files; ConfigError naming every damaged file if
    none is whole. `where`: how messages name the folder (default `--load DIR`)."""
    step, folder = resolve_checkpoint_dir(load_dir, ckpt_step, where=where)
    problems = checkpoint_problems(folder, verify)
    if not problems:
        return LoadChoice(step, folder)
    if ckpt_step is not None:
        raise ConfigError(
            f"--ckpt-step {ckpt_step}: {'; '.join(problems)}; pick another step "
            f"(available steps: {_show_steps(available_steps(load_dir))})"
        )
    damaged = list(problems)
    for earlier in reversed([s for s in available_steps(load_dir) if s < step]):
        candidate = Path(load_dir) / iter_dir_name(earlier)
        found = checkpoint_problems(candidate, verify)
        if not found:
            warning = (
                f"{where_named(load_dir, where)}: {'; '.join(damaged)}; loading {candidate.name}, the newest complete "
                "checkpoint"
            )
            return LoadChoice(earlier, candidate, [warning])
        damaged.extend(found)
    raise ConfigError(f"{where_named(load_dir, where)}: no complete checkpoint: {'; '.join(damaged)}")


def common_step(load_dirs: Iterable[str | os.PathLike], ckpt_step: int | None = None) -> int | None:
    """The one step every folder of `load_dirs` resumes from (DMD2's `<load>` and `<load>/critic`): `ckpt_step`
    when given; else the newest step complete in all of them, so a damaged latest checkpoint in one folder does
    not resume the two trainers at different steps. ConfigError when there is none."""
    dirs = [Path(d) for d in load_dirs]
    if ckpt_step is not None or not dirs:
        return ckpt_step
    choices = [find_loadable_checkpoint(d) for d in dirs]
    step = min(choice.step for choice in choices)
    for folder in dirs:
        problems = checkpoint_problems(folder / iter_dir_name(step))
        if problems or not (folder / iter_dir_name(step)).is_dir():
            raise ConfigError(
                f"--load {dirs[0]}: no step complete in every trainer's folder ({', '.join(map(str, dirs))}): "
                f"{'; '.join(problems) or f'{folder} has no step {step}'}; pass --ckpt-step"
            )
    return step
