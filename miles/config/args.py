"""`Args`: the resolved arguments of a job (or of one trainer), with the source of every value."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

# Where a resolved value came from. "override:<role>" marks a per-trainer override.
DEFAULT = "default"
RECIPE = "recipe"
CLI = "cli"
YAML = "yaml"
DERIVED = "derived"
SOURCES = (DEFAULT, RECIPE, CLI, YAML, DERIVED)


def override_source(role: str) -> str:
    return f"override:{role}"


class Args:
    """Attribute access to resolved values (`args.lr`), plus `sources_of()` and `job`.

    It behaves like the argparse namespace the runtime reads: every flag's dest is an attribute.
    Two extra fields are always present: `custom` (the recipe/YAML `custom:` mapping, untouched)
    and `sglang_args` (the `--sglang-KEY VALUE` passthrough).
    """

    __slots__ = ("_sources", "_values", "job", "trainer_overrides")

    def __init__(
        self,
        values: dict[str, Any],
        sources: dict[str, str],
        job: str,
        trainer_overrides: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        object.__setattr__(self, "_values", dict(values))
        object.__setattr__(self, "_sources", dict(sources))
        object.__setattr__(self, "job", job)
        object.__setattr__(self, "trainer_overrides", trainer_overrides or {})

    def __getattr__(self, name: str) -> Any:
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(f"no argument named {name!r}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in self._values:
            raise AttributeError(f"no argument named {name!r}")
        self._values[name] = value

    def __contains__(self, name: object) -> bool:
        return name in self._values

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Args):
            return NotImplemented
        return self.job == other.job and self._values == other._values and self._sources == other._sources

    def __repr__(self) -> str:
        return f"Args(job={self.job!r}, {len(self._values)} values)"

    def __copy__(self) -> Args:
        """A copy whose values can be set without touching this one's (the values themselves are shared)."""
        return Args(self._values, self._sources, self.job, self.trainer_overrides)

    def __deepcopy__(self, memo: dict[int, Any]) -> Args:
        return Args(
            copy.deepcopy(self._values, memo),
            dict(self._sources),
            self.job,
            copy.deepcopy(self.trainer_overrides, memo),
        )

    def __getstate__(self) -> dict[str, Any]:
        return {
            "values": self._values,
            "sources": self._sources,
            "job": self.job,
            "trainer_overrides": self.trainer_overrides,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        object.__setattr__(self, "_values", state["values"])
        object.__setattr__(self, "_sources", state["sources"])
        object.__setattr__(self, "job", state["job"])
        object.__setattr__(self, "trainer_overrides", state["trainer_overrides"])

    def to_dict(self) -> dict[str, Any]:
        """A deep copy of the values, keyed by dest."""
        return copy.deepcopy(self._values)

    def sources(self) -> dict[str, str]:
        return dict(self._sources)

    def source_of(self, name: str) -> str:
        return self._sources[name]

    def with_values(self, updates: dict[str, Any], source: str) -> Args:
        """A deep copy with `updates` applied and marked with `source`. `self` is left untouched."""
        clone = copy.deepcopy(self)
        for name, value in updates.items():
            if name not in clone._values:
                raise KeyError(name)
            clone._values[name] = copy.deepcopy(value)
            clone._sources[name] = source
        return clone
