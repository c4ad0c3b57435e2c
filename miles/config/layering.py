"""Reading recipes and `--custom-config-path` YAML files, and laying their keys onto a Resolution.

Precedence: defaults < recipe < command line < custom YAML (the YAML wins, with one warning per key
that overrides a value the recipe or the command line set).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles.config.args import CLI, YAML
from miles.config.catalog import FLAGS_BY_DEST, flag_for
from miles.config.flags import closest, to_dest
from miles.config.resolution import EXTRA_FIELDS, Resolution
from miles.core.errors import ConfigError

# Top-level keys of a recipe / YAML that are not flags.
META_KEYS = ("job", "description", "expect", "trainers", "custom", "sglang_args")


@dataclass
class ConfigFile:
    """A parsed recipe or YAML: its flag keys, meta keys and the line of every top-level key."""

    path: Path
    label: str  # how messages name it: "recipe sd35-4step" or "my.yaml"
    data: dict[str, Any]
    lines: dict[str, int] = field(default_factory=dict)

    @property
    def job(self) -> str | None:
        job = self.data.get("job")
        return str(job) if job is not None else None

    @property
    def description(self) -> str:
        return str(self.data.get("description") or "")

    @property
    def expect(self) -> str:
        """What a run of the recipe should show (a GPU recipe: the anchor's published curve, with its source)."""
        return " ".join(str(self.data.get("expect") or "").split())

    def where(self, key: str) -> str:
        line = self.lines.get(key)
        return f"{self.label}:{line}: key {key!r}" if line else f"{self.label}: key {key!r}"


def load_config_file(path: Path, label: str | None = None) -> ConfigFile:
    """Parse a YAML mapping, keeping the line of each top-level key for error messages. A key given twice
    (at any depth) is a ConfigError naming both lines."""
    from miles.config.yaml_file import load_yaml

    label = label or str(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{label}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"{label}: is a directory, not a YAML file") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{label}: not a text file (invalid UTF-8 at byte {exc.start})") from None
    except OSError as exc:
        raise ConfigError(f"{label}: cannot read ({exc.strerror})") from None
    data, node = load_yaml(text, label)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{label}: expected a mapping of keys to values at the top level")
    lines: dict[str, int] = {}
    if node is not None and isinstance(node.value, list):
        for key_node, _ in node.value:
            lines[str(key_node.value)] = key_node.start_mark.line + 1
    return ConfigFile(path=path, label=label, data=data, lines=lines)


def apply_file(res: Resolution, cfg: ConfigFile, source: str) -> None:
    """Lay a recipe's or YAML's keys onto `res` with `source` (recipe or yaml)."""
    for key, raw in cfg.data.items():
        key = str(key)
        if key in ("job", "description", "expect"):
            continue
        if key == "trainers":
            _apply_trainers(res, cfg, raw)
        elif key == "custom":
            if not isinstance(raw, dict):
                raise ConfigError(f"{cfg.where(key)}: expected a mapping")
            merged = copy.deepcopy(res["custom"])
            merged.update(copy.deepcopy(raw))
            res.set("custom", merged, source)
        elif key == "sglang_args":
            if not isinstance(raw, dict):
                raise ConfigError(f"{cfg.where(key)}: expected a mapping of sglang server args")
            for sg_key, value in raw.items():
                set_sglang_arg(res, to_dest(str(sg_key)), value, source, cfg.where(key))
        else:
            flag = flag_for(key)
            if flag is None:
                dest = to_dest(key)
                if dest.startswith("sglang_"):
                    set_sglang_arg(res, dest[len("sglang_") :], raw, source, cfg.where(key))
                    continue
                raise ConfigError(f"{cfg.where(key)}: unknown key{_suggest(dest)}")
            value = flag.parse(raw, cfg.where(key))
            if source == YAML:
                _warn_yaml_override(res, flag.dest, value, cfg.where(key))
            res.set(flag.dest, value, source)


def apply_cli(res: Resolution, given: dict[str, Any]) -> None:
    """Lay the flags given on the command line (dest -> raw value) onto `res`."""
    for dest, raw in given.items():
        flag = FLAGS_BY_DEST[dest]
        res.set(flag.dest, flag.parse(raw, flag.option), CLI)


def set_sglang_arg(res: Resolution, key: str, value: Any, source: str, where: str) -> None:
    from miles.config.sglang_passthrough import check_sglang_key

    check_sglang_key(key, where)
    merged = dict(res["sglang_args"])
    merged[key] = value
    res.set("sglang_args", merged, source)


def parse_override(res: Resolution, text: str, roles: tuple[str, ...], base_role: str, where: str) -> None:
    """`ROLE.KEY=VALUE` (from --override) into res.trainer_overrides."""
    head, eq, value = text.partition("=")
    role, dot, key = head.partition(".")
    if not eq or not dot or not key:
        raise ConfigError(f"{where}: expected ROLE.KEY=VALUE, got {text!r}")
    add_override(res, role, key, value, roles, base_role, f"{where} {text}")


def add_override(res: Resolution, role: str, key: str, raw: Any, roles: tuple[str, ...], base_role: str, where: str):
    others = tuple(r for r in roles if r != base_role)
    flag = flag_for(key)
    if role == base_role:
        if flag is None:
            raise ConfigError(f"{where}: unknown argument {key!r}{_suggest(to_dest(key), flags_only=True)}")
        raise ConfigError(f"{where}: the {base_role} takes the job's own flags; set {flag.option} directly")
    if role not in others:
        have = f"this job's trainers: {', '.join(roles)}"
        raise ConfigError(f"{where}: no trainer {role!r} to override ({have})")
    if flag is None:
        suggestion = _suggest(to_dest(key), flags_only=True)
        raise ConfigError(f"{where}: unknown argument {key!r} for trainer {role!r}{suggestion}")
    res.trainer_overrides.setdefault(role, {})[flag.dest] = flag.parse(raw, where)


def _apply_trainers(res: Resolution, cfg: ConfigFile, raw: Any) -> None:
    from miles.config.jobs import job_spec

    if not isinstance(raw, dict):
        raise ConfigError(f"{cfg.where('trainers')}: expected a mapping of trainer roles to overrides")
    if cfg.job is not None and cfg.job != res.job:
        return  # another job's trainers (e.g. `miles eval` of a dmd2 recipe evaluates the student only)
    roles = job_spec(res.job).trainer_roles
    for role, overrides in raw.items():
        if not isinstance(overrides, dict):
            raise ConfigError(f"{cfg.where('trainers')}: trainers.{role} must be a mapping of arguments")
        for key, value in overrides.items():
            add_override(res, str(role), str(key), value, roles, "actor", f"{cfg.where('trainers')}: {role}.{key}")


def _warn_yaml_override(res: Resolution, dest: str, value: Any, where: str) -> None:
    if res.explicit(dest) and res[dest] != value:
        res.warn(f"{where} overrides {res.show(dest)} with {FLAGS_BY_DEST[dest].format(value)}")


def _suggest(dest: str, flags_only: bool = False) -> str:
    """A close known key (`flags_only`: a flag, for what a trainer override may name)."""
    names = [*FLAGS_BY_DEST] if flags_only else [*FLAGS_BY_DEST, *EXTRA_FIELDS, *META_KEYS]
    names = [name for name in names if name != dest]
    hint = closest(dest, names)
    return f" (did you mean {hint!r}?)" if hint else ""
