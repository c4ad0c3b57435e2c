"""The flag catalogue: every flag of the CLI reference (plus the miles additions), by help panel.

Each module in this package declares one help panel: `GROUP` (the panel name) and `FLAGS`.
This package imports nothing but `miles.config.flags` and the torch-free tables (the job table
`miles.config.jobs` for the flags' job scopes, the method and reward tables), so it is safe for `miles --help`.

Defaults that are mutable (`--train-env-vars` {}, list defaults such as
`--update-weight-target-module`) are shared by the frozen `Flag` objects: callers must
deep-copy a default before mutating it.
"""

from __future__ import annotations

from miles.config.catalog import (
    algorithm,
    backend,
    checkpoint,
    ci,
    cluster,
    data,
    debug,
    dmd2,
    ema,
    evaluation,
    fault_tolerance,
    hooks,
    job,
    logging,
    lora,
    optimizer,
    reward,
    rollout,
)
from miles.config.flags import BOOL, ENUM, TRISTATE, Flag, to_dest

__all__ = ["ALL_FLAGS", "FLAGS_BY_DEST", "FLAGS_BY_GROUP", "GROUPS", "flag_for"]

# The reference's group order; it is also the order of the --help panels.
_MODULES = (
    job,
    cluster,
    backend,
    optimizer,
    rollout,
    data,
    evaluation,
    algorithm,
    reward,
    hooks,
    lora,
    ema,
    checkpoint,
    logging,
    fault_tolerance,
    debug,
    ci,
    dmd2,
)

GROUPS: tuple[str, ...] = tuple(module.GROUP for module in _MODULES)
FLAGS_BY_GROUP: dict[str, tuple[Flag, ...]] = {module.GROUP: tuple(module.FLAGS) for module in _MODULES}
ALL_FLAGS: tuple[Flag, ...] = tuple(flag for module in _MODULES for flag in module.FLAGS)


def _build_index(flags: tuple[Flag, ...]) -> dict[str, Flag]:
    """dest -> flag, for every flag's own dest and each alias's dest; fails on any clash."""
    index: dict[str, Flag] = {}
    for flag in flags:
        if flag.group not in GROUPS:
            raise ValueError(f"flag --{flag.name}: group {flag.group!r} is not one of the catalogue groups")
        if flag.kind == ENUM and flag.default is not None and flag.default not in (flag.choices or ()):
            raise ValueError(f"flag --{flag.name}: default {flag.default!r} is not one of its choices")
        for name in (flag.name, *flag.aliases):
            dest = to_dest(name)
            other = index.get(dest)
            if other is not None:
                raise ValueError(f"flag --{name} clashes with --{other.name} (both have dest {dest!r})")
            index[dest] = flag
    # The second spelling of an on/off flag (--x/--no-x) must not be another flag's name.
    for flag in flags:
        if flag.kind in (BOOL, TRISTATE):
            negative = to_dest(flag.negative_option())
            other = index.get(negative)
            if other is not None and other is not flag:
                raise ValueError(f"{flag.negative_option()} (negative of --{flag.name}) clashes with --{other.name}")
    return index


FLAGS_BY_DEST: dict[str, Flag] = _build_index(ALL_FLAGS)


def flag_for(name: str) -> Flag | None:
    """The flag named `name` ("--x-y", "x-y" or "x_y", or an alias), or None when unknown."""
    return FLAGS_BY_DEST.get(to_dest(name.strip()))
