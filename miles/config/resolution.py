"""`Resolution`: the working state while a job's arguments are layered, derived and checked."""

from __future__ import annotations

import copy
from typing import Any, NoReturn

from miles.config.args import CLI, DEFAULT, DERIVED, RECIPE, YAML, Args
from miles.config.catalog import ALL_FLAGS, FLAGS_BY_DEST
from miles.config.flags import Flag
from miles.core.errors import ConfigError

# Fields that are not flags but travel with the args.
EXTRA_FIELDS: dict[str, Any] = {"custom": {}, "sglang_args": {}}
# Fields only the rules write (never a recipe, the command line or a YAML): `inputs`, the built-in names among the
# job's model and data flags -> where they live under $MILES_HOME (`miles.config.rules.inputs`).
DERIVED_FIELDS: dict[str, Any] = {"inputs": {}}

_SOURCE_WORDS = {DEFAULT: "default", RECIPE: "from the recipe", CLI: "on the command line", YAML: "from the YAML"}


class Resolution:
    """Values and their sources while layering; the rules read and derive through it."""

    def __init__(self, job: str) -> None:
        self.job = job
        self.values: dict[str, Any] = {f.dest: copy.deepcopy(f.default) for f in ALL_FLAGS}
        self.values.update(copy.deepcopy(EXTRA_FIELDS))
        self.values.update(copy.deepcopy(DERIVED_FIELDS))
        self.sources: dict[str, str] = dict.fromkeys(self.values, DEFAULT)
        # every value a flag took, in order, with its source: which values a layer saw before a later one changed
        # them (the grid a recipe chose its SDE step indices on, `miles.config.rules.denoising`)
        self.history: dict[str, list[tuple[str, Any]]] = {}
        self.warnings: list[str] = []
        # Raw per-role overrides, parsed: {role: {dest: value}}, with where each came from.
        self.trainer_overrides: dict[str, dict[str, Any]] = {}
        self.override_origins: dict[tuple[str, str], str] = {}

    # ---- reading -------------------------------------------------------------------------
    def __getitem__(self, dest: str) -> Any:
        return self.values[dest]

    def get(self, dest: str) -> Any:
        return self.values[dest]

    def source(self, dest: str) -> str:
        return self.sources[dest]

    def explicit(self, dest: str) -> bool:
        """Set by the user: in the recipe, on the command line or in the YAML."""
        return self.sources[dest] in (RECIPE, CLI, YAML)

    def show(self, dest: str) -> str:
        """'--rollout-batch-size 32 (recipe)': a flag, its value and its source, for messages."""
        flag = FLAGS_BY_DEST.get(dest)
        value = self.values[dest]
        text = flag.format(value) if flag else str(value)
        return f"{_option(dest)} {text} ({self.sources[dest]})"

    # ---- writing -------------------------------------------------------------------------
    def set(self, dest: str, value: Any, source: str) -> None:
        self.values[dest] = value
        self.sources[dest] = source
        self.history.setdefault(dest, []).append((source, value))

    def value_at(self, dest: str, sources: tuple[str, ...]) -> Any:
        """`dest`'s value as the layers in `sources` (and the default) left it: the last one they set."""
        for source, value in reversed(self.history.get(dest, [])):
            if source in sources:
                return value
        flag = FLAGS_BY_DEST.get(dest)
        return copy.deepcopy(flag.default) if flag is not None else None

    def derive(self, dest: str, value: Any) -> None:
        self.set(dest, value, DERIVED)

    def warn(self, message: str) -> None:
        self.warnings.append(message)

    def fail(self, message: str) -> NoReturn:
        raise ConfigError(message)

    def not_applicable(self, dest: str, reason: str, advice: str = "remove it") -> None:
        """`dest`'s value does not apply under the job's other settings (`reason`). Refused where the user set it
        (command line or YAML: "FLAG VALUE (cli): REASON; ADVICE"); a recipe's value falls back to the flag's default
        with a warning, because the user changed another setting and never typed this one (`--debug-rollout-only`
        on a recipe that trains)."""
        if self.sources[dest] != RECIPE:
            self.fail(f"{self.show(dest)}: {reason}; {advice}")
        flag = FLAGS_BY_DEST[dest]
        if flag.default is None:
            fallback = "the recipe's value is not used"
        else:
            fallback = f"using {_option(dest)} {flag.format(flag.default)} instead"
        self.warn(f"{self.show(dest)}: {reason}; {fallback}")
        self.derive(dest, copy.deepcopy(flag.default))

    def to_args(self) -> Args:
        return Args(self.values, self.sources, self.job, copy.deepcopy(self.trainer_overrides))


def _option(dest: str) -> str:
    flag: Flag | None = FLAGS_BY_DEST.get(dest)
    return flag.option if flag else dest


def schema_args(job: str = "rl", **values: Any) -> Args:
    """The catalogue's defaults, unresolved (no recipe, no rules but `inputs`: a derived flag such as
    `--rollout-backend` keeps its `auto`), with `values` on top (source `cli`). For a caller of one function
    (tests, benches) that needs real `Args` without a whole job; a job's args come from
    `miles.config.resolve.resolve`."""
    from miles.config.flags import closest

    res = Resolution(job)
    for name, value in values.items():
        if name not in res.values:
            hint = closest(name, list(res.values))
            raise ConfigError(f"no argument named {name!r}" + (f" (did you mean {hint!r}?)" if hint else ""))
        res.set(name, value, CLI)
    from miles.config.rules.inputs import derive_inputs

    derive_inputs(res)  # where its built-in names live, as every job's first rule derives it
    return res.to_args()
