"""Shipped recipes (`recipes/*.yaml`) and recipe lookup by name or path."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from miles.config.flags import closest
from miles.core.errors import ConfigError


def recipe_dirs() -> list[Path]:
    """Where shipped recipes live: inside an installed wheel, or at the root of a source checkout."""
    package = Path(__file__).resolve().parent.parent
    return [d for d in (package / "recipes", package.parent / "recipes") if d.is_dir()]


@dataclass(frozen=True)
class RecipeInfo:
    name: str
    path: Path


def shipped_recipes() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for directory in recipe_dirs():
        for path in sorted(directory.glob("*.yaml")):
            found.setdefault(path.stem, path)
    return found


def find_recipe(name_or_path: str) -> RecipeInfo:
    """A recipe by shipped name (`sd35-4step`) or by path (`my/recipe.yaml`)."""
    looks_like_path = name_or_path.endswith((".yaml", ".yml")) or "/" in name_or_path
    if looks_like_path:
        path = Path(name_or_path).expanduser()
        if not path.is_file():
            raise ConfigError(f"--recipe {name_or_path}: no such file")
        return RecipeInfo(path.stem, path)
    shipped = shipped_recipes()
    if name_or_path in shipped:
        return RecipeInfo(name_or_path, shipped[name_or_path])
    hint = closest(name_or_path, shipped)
    suffix = f" (did you mean {hint!r}?)" if hint else ""
    raise ConfigError(
        f"--recipe {name_or_path}: no such recipe{suffix}; shipped: {', '.join(shipped) or 'none'} "
        "(or give a path to a .yaml file)"
    )
