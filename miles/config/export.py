"""Resolved args as JSON and as YAML that `--custom-config-path` reads back (torch-free)."""

from __future__ import annotations

from typing import Any

from miles.config.args import DEFAULT, Args
from miles.config.catalog import ALL_FLAGS

_EXTRA_ORDER = ("custom", "sglang_args", "inputs")
# The YAML itself is what --custom-config-path will point at; `inputs` is derived again from the flags it names.
_NOT_EXPORTED = frozenset({"custom_config_path", "inputs"})


def arg_order() -> list[str]:
    """Flag dests in catalogue (help panel) order, then the extra fields."""
    return [flag.dest for flag in ALL_FLAGS] + list(_EXTRA_ORDER)


def to_json_dict(job: str, trainer_args: dict[str, Args]) -> dict[str, Any]:
    """{"job": ..., "trainers": {ROLE: {arg: value}}, "sources": {ROLE: {arg: source}}}."""
    order = arg_order()
    return {
        "job": job,
        "trainers": {role: {k: args.to_dict()[k] for k in order} for role, args in trainer_args.items()},
        "sources": {role: {k: args.sources()[k] for k in order} for role, args in trainer_args.items()},
    }


def to_yaml_mapping(args: Args) -> dict[str, Any]:
    """The job, every value that is not a default, and the user's per-trainer overrides.

    Fed back through `--custom-config-path`, it resolves to the same per-trainer args.
    """
    values, sources = args.to_dict(), args.sources()
    out: dict[str, Any] = {"job": args.job}
    for dest in arg_order():
        if sources[dest] != DEFAULT and dest not in _NOT_EXPORTED:
            out[dest] = values[dest]
    if args.trainer_overrides:
        out["trainers"] = {role: dict(over) for role, over in args.trainer_overrides.items()}
    return out


def to_yaml_text(args: Args) -> str:
    import yaml

    return yaml.safe_dump(to_yaml_mapping(args), sort_keys=False, default_flow_style=None, width=119)
