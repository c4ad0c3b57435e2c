"""The flag model: one `Flag` per command-line flag, parsed the same way from every source.

This module is torch-free and Ray-free: it is imported by `miles --help`.

A flag's *dest* (its snake_case name) is the key used everywhere else: recipes, the
`--custom-config-path` YAML, `--override ROLE.KEY=VALUE`, the resolved args and the json
output of `inspect-config`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from miles.core.errors import ConfigError

# Kinds of flag. The kind decides how a raw value (a CLI string, a YAML scalar or list) is parsed.
INT = "int"
FLOAT = "float"
STR = "str"
BOOL = "bool"  # on/off flag; `--x/--no-x` on the command line
TRISTATE = "tristate"  # None (unset), True or False; `--x/--no-x`
ENUM = "enum"  # str restricted to `choices`
JSON = "json"  # a JSON object given as a string (a mapping in YAML)
INT_RANGE = "int_range"  # "lo,hi" -> [lo, hi]
INT_LIST = "int_list"  # "1,2,3" -> [1, 2, 3]
STR_LIST = "str_list"  # "a,b" or repeated -> ["a", "b"]
NAMED_PATHS = "named_paths"  # repeatable NAME PATH -> {name: path}
DOTTED = "dotted"  # a dotted Python path "pkg.module.attr"
WEIGHTS = "weights"  # "a=1,b=0.2" or a mapping {a: 1, b: 0.2} -> {name: float}
PATH = "path"  # a filesystem path or path template (kept as a string)

KINDS = (
    INT,
    FLOAT,
    STR,
    BOOL,
    TRISTATE,
    ENUM,
    JSON,
    INT_RANGE,
    INT_LIST,
    STR_LIST,
    NAMED_PATHS,
    DOTTED,
    PATH,
    WEIGHTS,
)

_DOTTED_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+$")
_FLOAT_RE = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?$|^[+-]?(inf|nan)$", re.IGNORECASE)


@dataclass(frozen=True, eq=False)
class Flag:
    """One flag of the schema.

    name: the long flag without dashes, e.g. "rollout-batch-size".
    kind: one of KINDS.
    default: the resolved default (None = unset). For BOOL it is False unless stated.
    group: the help panel, named after the CLI reference's groups.
    choices: allowed values for ENUM (and for each item of STR_LIST, each name of WEIGHTS, when given).
    aliases: other long names accepted on the command line and in YAML (e.g. "debug-train-only").
    jobs: the jobs the flag means something to; None = every job. Setting it on the command
        line (or in the custom YAML) for another job is an error naming both.
    min / max: inclusive bounds for INT / FLOAT (and for each item of INT_LIST / INT_RANGE).
    metavar: shown in --help.
    allow_inf: a FLOAT flag whose reference gives +-infinity a meaning (e.g. "no limit"); every other
        FLOAT refuses it. NaN is refused by every flag.
    """

    name: str
    kind: str
    default: Any = None
    help: str = ""
    group: str = ""
    choices: tuple[str, ...] | None = None
    aliases: tuple[str, ...] = ()
    jobs: frozenset[str] | None = None
    min: float | None = None
    max: float | None = None
    metavar: str | None = None
    allow_inf: bool = False
    meta: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"flag --{self.name}: unknown kind {self.kind!r}")
        if self.kind == ENUM and not self.choices:
            raise ValueError(f"flag --{self.name}: an enum needs choices")
        if self.kind == BOOL and self.default is None:
            object.__setattr__(self, "default", False)

    @property
    def dest(self) -> str:
        return to_dest(self.name)

    @property
    def option(self) -> str:
        return f"--{self.name}"

    def negative_option(self) -> str:
        """The second spelling of a BOOL/TRISTATE flag: --x -> --no-x, --no-x -> --x."""
        if self.name.startswith("no-"):
            return f"--{self.name[3:]}"
        return f"--no-{self.name}"

    def parse(self, raw: Any, where: str) -> Any:
        """Parse `raw` (a CLI string or a YAML value) into this flag's type.

        `where` names the source for the error message, e.g. "--lr" or "recipe.yaml: key 'lr'".
        None (a YAML `null`, `~` or empty value) means unset, except for a number whose default is not None:
        there it is refused, since every consumer reads a number.
        """
        if raw is None:
            if self.kind in (INT, FLOAT) and self.default is not None:
                default = self.format(self.default)
                raise ConfigError(
                    f"{where}: expected a number, got null; remove the key to keep the default {default}"
                )
            return None
        try:
            value = _PARSERS[self.kind](self, raw)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"{where}: {exc}") from None
        if self.kind == FLOAT:
            self._check_finite(value, raw, where)
        self._check_bounds(value, where)
        return value

    def _check_finite(self, value: float, raw: Any, where: str) -> None:
        if math.isfinite(value) or (self.allow_inf and not math.isnan(value)):
            return
        shown = str(raw).strip()[:40] if isinstance(raw, str) else str(value)
        if math.isnan(value):
            what = "is not a number"
        elif "inf" in shown.lower():
            what = "is infinite"
        else:
            what = "overflows to infinity"
        expected = "a number (inf is allowed)" if self.allow_inf else "a finite number"
        raise ConfigError(f"{where}: {shown} {what}; expected {expected}")

    def _check_bounds(self, value: Any, where: str) -> None:
        if value is None:
            return
        items: Iterable[Any]
        if self.kind in (INT, FLOAT):
            items = [value]
        elif self.kind in (INT_LIST, INT_RANGE):
            items = value
        else:
            return
        for item in items:
            if isinstance(item, int) and not -(2**63) <= item < 2**63:  # what torch, numpy and C code can hold
                shown = str(item) if len(str(item)) <= 24 else f"{str(item)[:20]}... ({len(str(item))} digits)"
                raise ConfigError(f"{where}: {shown} does not fit in 64 bits")
            if self.min is not None and item < self.min:
                raise ConfigError(f"{where}: {item} is below the minimum {_num(self.min)}")
            if self.max is not None and item > self.max:
                raise ConfigError(f"{where}: {item} is above the maximum {_num(self.max)}")

    def format(self, value: Any) -> str:
        """The value as a user would type it on the command line."""
        if value is None:
            return "-"
        if self.kind in (BOOL, TRISTATE):
            return "on" if value else "off"
        if self.kind in (INT_RANGE, INT_LIST, STR_LIST):
            return ",".join(str(v) for v in value)
        if self.kind == JSON:
            return json.dumps(value, sort_keys=True)
        if self.kind == NAMED_PATHS:
            return " ".join(f"{k}={v}" for k, v in value.items())
        if self.kind == WEIGHTS:
            return ",".join(f"{k}={_num(v)}" for k, v in value.items())
        return str(value)


def to_dest(name: str) -> str:
    """'rollout-batch-size' / '--rollout-batch-size' / 'rollout_batch_size' -> 'rollout_batch_size'."""
    return name.lstrip("-").replace("-", "_")


def to_option(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _parse_int(flag: Flag, raw: Any) -> int:
    if isinstance(raw, bool):
        raise ValueError(f"expected an integer, got {raw!r}")
    if isinstance(raw, int):
        return raw
    if isinstance(raw, float) and raw.is_integer():
        return int(raw)
    text = str(raw).strip().replace("_", "")
    if re.fullmatch(r"[+-]?\d+", text):
        return int(text)
    # 2e9-style integers are common for buffer sizes.
    if _FLOAT_RE.match(text) and float(text).is_integer():
        return int(float(text))
    raise ValueError(f"expected an integer, got {raw!r}")


def _parse_float(flag: Flag, raw: Any) -> float:
    if isinstance(raw, bool):
        raise ValueError(f"expected a number, got {raw!r}")
    if isinstance(raw, (int, float)):
        return float(raw)
    text = str(raw).strip()
    if _FLOAT_RE.match(text):
        return float(text)
    raise ValueError(f"expected a number, got {raw!r}")


_TRUE = {"1", "true", "yes", "on", "y"}
_FALSE = {"0", "false", "no", "off", "n"}


def _parse_bool(flag: Flag, raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, int) and raw in (0, 1):
        return bool(raw)
    text = str(raw).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(f"expected true or false, got {raw!r}")


def _parse_str(flag: Flag, raw: Any) -> str:
    if isinstance(raw, (dict, list, tuple)):
        raise ValueError(f"expected a string, got {type(raw).__name__}")
    return str(raw)


def _parse_enum(flag: Flag, raw: Any) -> str:
    text = _parse_str(flag, raw)
    assert flag.choices is not None
    if text not in flag.choices:
        raise ValueError(f"{text!r} is not one of {', '.join(flag.choices)}{_did_you_mean(text, flag.choices)}")
    return text


def _parse_json(flag: Flag, raw: Any) -> dict[str, Any]:
    if isinstance(raw, dict):
        return dict(raw)
    try:
        value = json.loads(str(raw))
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc.msg} at column {exc.colno}): {raw!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {raw!r}")
    return value


def _split_items(raw: Any) -> list[Any]:
    if isinstance(raw, (list, tuple)):
        items: list[Any] = []
        for item in raw:
            items.extend(_split_items(item) if isinstance(item, str) else [item])
        return items
    text = str(raw).strip().strip("[]()")
    return [part.strip() for part in text.split(",") if part.strip()]


def _parse_int_list(flag: Flag, raw: Any) -> list[int]:
    items = _split_items(raw)
    if not items:
        raise ValueError(f"expected a comma-separated list of integers like '1,2,3', got {raw!r}")
    try:
        return [_parse_int(flag, item) for item in items]
    except ValueError:
        raise ValueError(f"expected a comma-separated list of integers like '1,2,3', got {raw!r}") from None


def _parse_int_range(flag: Flag, raw: Any) -> list[int]:
    try:
        items = _parse_int_list(flag, raw)
    except ValueError:
        items = []
    if len(items) != 2:
        raise ValueError(f"expected 'lo,hi', got {raw!r}")
    if items[0] >= items[1]:
        raise ValueError(f"expected 'lo,hi' with lo < hi, got {raw!r}")
    return items


def _parse_str_list(flag: Flag, raw: Any) -> list[str]:
    items = [str(item) for item in _split_items(raw)]
    if not items:
        raise ValueError(f"expected a comma-separated list, got {raw!r}")
    if flag.choices:
        for item in items:
            if item not in flag.choices:
                raise ValueError(f"{item!r} is not one of {', '.join(flag.choices)}")
    return items


def _parse_named_paths(flag: Flag, raw: Any) -> dict[str, str]:
    """{name: path} from a mapping, a list of [name, path] pairs, or a flat even list."""
    if isinstance(raw, dict):
        return {str(k): str(v) for k, v in raw.items()}
    if isinstance(raw, str):
        raw = [raw] if "=" in raw and " " not in raw else raw.split()
    if not isinstance(raw, (list, tuple)):
        raise ValueError(f"expected NAME PATH pairs, got {raw!r}")
    flat: list[str] = []
    for item in raw:
        if isinstance(item, (list, tuple)):
            flat.extend(str(x) for x in item)
        elif isinstance(item, str) and "=" in item:
            flat.extend(item.split("=", 1))  # the CLI hands over NAME=PATH
        else:
            flat.append(str(item))
    if not flat or len(flat) % 2:
        raise ValueError(f"expected NAME PATH pairs, got {raw!r}")
    result: dict[str, str] = {}
    for name, path in zip(flat[::2], flat[1::2], strict=True):
        if name in result:
            raise ValueError(f"the name {name!r} is given twice")
        result[name] = path
    return result


def _parse_weights(flag: Flag, raw: Any) -> dict[str, float]:
    """`name=w,name=w` or a mapping (YAML `{digit: 1.0, ocr: 0.5}`, or that mapping as JSON/YAML text)."""
    example = "like 'digit=1,ocr=0.5'"
    if isinstance(raw, dict):
        items = [(str(k), v) for k, v in raw.items()]
    else:
        text = _parse_str(flag, raw).strip()
        if text.startswith("{"):
            import yaml

            try:
                loaded = yaml.safe_load(text)
            except yaml.YAMLError:
                loaded = None
            if not isinstance(loaded, dict):
                raise ValueError(f"expected a mapping like '{{digit: 1.0, ocr: 0.5}}', got {raw!r}")
            items = [(str(k), v) for k, v in loaded.items()]
        else:
            items = []
            for part in (p.strip() for p in text.split(",")):
                name, eq, value = part.partition("=")
                if not eq or not name.strip():
                    raise ValueError(f"{part!r} is not NAME=WEIGHT ({example})")
                items.append((name.strip(), value.strip()))
    if not items:
        raise ValueError(f"expected at least one NAME=WEIGHT ({example})")
    weights: dict[str, float] = {}
    for name, value in items:
        if flag.choices and name not in flag.choices:
            raise ValueError(f"{name!r} is not one of {', '.join(flag.choices)}{_did_you_mean(name, flag.choices)}")
        if name in weights:
            raise ValueError(f"{name!r} is given twice")
        if isinstance(value, bool):
            raise ValueError(f"the weight of {name!r} must be a number, got {value!r}")
        try:
            weight = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"the weight of {name!r} is not a number: {value!r}") from None
        if not math.isfinite(weight):
            raise ValueError(f"the weight of {name!r} must be a finite number, got {value!r}")
        weights[name] = weight
    return weights


def _parse_dotted(flag: Flag, raw: Any) -> str:
    text = _parse_str(flag, raw).strip()
    if not _DOTTED_RE.match(text):
        raise ValueError(f"expected a dotted Python path like 'my_pkg.module.function', got {raw!r}")
    return text


_PARSERS: dict[str, Callable[[Flag, Any], Any]] = {
    INT: _parse_int,
    FLOAT: _parse_float,
    STR: _parse_str,
    PATH: _parse_str,
    BOOL: _parse_bool,
    TRISTATE: _parse_bool,
    ENUM: _parse_enum,
    JSON: _parse_json,
    INT_RANGE: _parse_int_range,
    INT_LIST: _parse_int_list,
    STR_LIST: _parse_str_list,
    NAMED_PATHS: _parse_named_paths,
    DOTTED: _parse_dotted,
    WEIGHTS: _parse_weights,
}


def _did_you_mean(word: str, candidates: Iterable[str]) -> str:
    suggestion = closest(word, candidates)
    return f" (did you mean {suggestion!r}?)" if suggestion else ""


def closest(word: str, candidates: Iterable[str]) -> str | None:
    """The closest candidate to `word`, or None when nothing is close."""
    import difflib

    matches = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return matches[0] if matches else None
