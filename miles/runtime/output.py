"""The run's output directory: resolved config, metrics.jsonl, images, rollouts.

One job per output directory: `prepare_output_dir` takes an exclusive `flock` on `<output-dir>/.miles.lock`
before it writes anything there, and holds it open for the life of the process. The kernel drops the lock
when the process ends (however it ends), so a lock file left by a killed job never blocks the next one; a
second job on a directory in use refuses with one line naming the holder.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles.config.export import to_json_dict, to_yaml_text
from miles.core.errors import ConfigError
from miles.utils.atomic import atomic_write_text
from miles.utils.disk import DiskFull, is_disk_full, writing

if TYPE_CHECKING:
    from miles.config.resolve import ResolvedJob


LOCK_FILE = ".miles.lock"
_COMMAND_LIMIT = 300  # characters of the holder's command line shown in the refusal


@dataclass
class OutputDirLock:
    """The exclusive lock of one output directory, held by this process while `fd` is open."""

    directory: Path
    fd: int

    def release(self) -> None:
        """Drop the lock (tests; a job simply exits). The lock file stays: it is harmless once unlocked."""
        if self.fd >= 0:
            os.close(self.fd)  # closing the descriptor releases the flock
            self.fd = -1
        _HELD.pop(_key(self.directory), None)


_HELD: dict[str, OutputDirLock] = {}  # real path -> lock: keeps the descriptors open until the process exits


def lock_output_dir(out: str | os.PathLike) -> OutputDirLock:
    """Create `out` and take its job lock; ConfigError naming the holder if another process has it.

    Re-entrant within one process (a second job run in the same process on the same directory keeps the lock)."""
    import fcntl

    directory = Path(out)
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"--output-dir {directory}: exists and is not a directory")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        if is_disk_full(exc):  # a runtime condition, not a mistake in the flag: exit 1
            raise DiskFull(directory) from None
        raise ConfigError(f"--output-dir {directory}: cannot create it ({exc.strerror})") from None
    held = _HELD.get(_key(directory))
    if held is not None and held.fd >= 0:
        return held
    lock_path = directory / LOCK_FILE
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        if is_disk_full(exc):
            raise DiskFull(lock_path) from None
        raise ConfigError(f"--output-dir {directory}: cannot write {LOCK_FILE} ({exc.strerror})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _describe_holder(fd)
        os.close(fd)
        raise ConfigError(
            f"--output-dir {directory}: in use by another job ({holder}); "
            "wait for it to end or give another --output-dir"
        ) from None
    except OSError as exc:  # a filesystem without flock (some network mounts): run unlocked, as before
        print(
            f"miles: warning: --output-dir {directory}: cannot lock it ({exc.strerror}); "
            "make sure no other job writes there",
            file=sys.stderr,
        )
    _write_holder(fd)
    lock = OutputDirLock(directory, fd)
    _HELD[_key(directory)] = lock
    return lock


def release_output_dir(out: str | os.PathLike) -> None:
    """Drop this process's lock of `out`, if it holds one."""
    lock = _HELD.get(_key(Path(out)))
    if lock is not None:
        lock.release()


def _key(directory: Path) -> str:
    return os.path.realpath(directory)


def _write_holder(fd: int) -> None:
    argv = [Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "python", *sys.argv[1:]]
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime())
    record = {"pid": os.getpid(), "command": shlex.join(argv), "started": started}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)


def _describe_holder(fd: int) -> str:
    try:
        record = json.loads(os.pread(fd, 64 * 1024, 0).decode("utf-8", "replace"))
        pid, command, started = int(record["pid"]), str(record["command"]), str(record.get("started", "?"))
    except (OSError, ValueError, KeyError, TypeError):
        return "its pid is not written yet"
    command = " ".join(command.split())  # one line, whatever the holder's arguments held
    if len(command) > _COMMAND_LIMIT:
        command = command[: _COMMAND_LIMIT - 3] + "..."
    return f"pid {pid}, started {started}: {command}"


def prepare_output_dir(resolved: ResolvedJob) -> Path:
    """Take the job lock of `--output-dir` (ConfigError if another job holds it), then write `config.yaml`
    (re-runnable via --custom-config-path; a training job with --save also writes it into that folder) and
    `config.json`. The lock lives until the process exits."""
    out = Path(resolved.args.output_dir)
    with writing(out / LOCK_FILE):  # a full disk: one DiskFull naming the folder's first file
        lock_output_dir(out)
    config = to_yaml_text(resolved.args)
    atomic_write_text(out / "config.yaml", config)
    if resolved.args.save and resolved.spec.saves_checkpoints:
        # the checkpoints carry the config that rebuilds their model (`miles export CHECKPOINT_DIR`)
        save = Path(str(resolved.args.save)).expanduser()
        save.mkdir(parents=True, exist_ok=True)
        atomic_write_text(save / "config.yaml", config)
    atomic_write_text(
        out / "config.json", json.dumps(to_json_dict(resolved.spec.name, resolved.trainer_args), indent=2)
    )
    return out


def export_due(args: Any, rollout_id: int, num_rollout: int) -> bool:
    """`--export-interval N`: after every N-th rollout (iteration of `train sft`), and after the last."""
    if not args.export_interval:
        return False
    return rollout_id == num_rollout - 1 or (rollout_id + 1) % args.export_interval == 0


def export_at(args: Any, group: Any, trained: int, unit: str = "rollout") -> Path:
    """The periodic export after `trained` rollouts (`unit` "iter": SFT iterations):
    `<output-dir>/exports/<unit>_<trained>/` holding `lora/`
    (diffusers format, with --use-lora) and `pipeline/` (with --export-merged, or without LoRA), each written
    atomically; then `exports/latest.txt` names it, so a killed export leaves the previous one the latest."""
    exports = Path(args.output_dir) / "exports"
    target = exports / f"{unit}_{trained:06d}"
    written = []
    if args.use_lora:
        group.call("export_lora", str(target / "lora"))
        written.append("lora")
    if args.export_merged or not args.use_lora:
        group.call("export_pipeline", str(target / "pipeline"))
        written.append("pipeline")
    atomic_write_text(exports / "latest.txt", target.name + "\n")
    print(f"miles: exported {unit} {trained} ({' and '.join(written)}) to {target}")
    return target


def export_final(args: Any, group: Any, what: str = "trained") -> Path:
    """Rank 0 of `group` writes the trained pipeline to `<output-dir>/checkpoint` (loadable with
    `from_pretrained`); every training job ends with it."""
    target = Path(args.output_dir) / "checkpoint"
    group.call("export_pipeline", str(target))
    print(f"miles: exported the {what} pipeline to {target}")
    return target
