"""The one loader of the objects miles names by a dotted path (user hooks, families' diffusers classes, reward
builders, the job drivers, what a lower floor needs from a higher one). Torch-free; it imports nothing of miles,
so it sits on the floor of core (tests/test_import_layers.py).

A path is `package.module.attribute`, the longest importable module prefix taken as the module (so
`pkg.mod.Class.method` works too), or `package.module:attribute` (the module named before the colon, nested
attributes after it). A ModuleNotFoundError for the prefix itself (or one of its parents) only means "not a
module, try a shorter one"; any other failure to import (a missing dependency inside the module, an error it
raises) is the module's own and is reported.

`load_dotted` raises what went wrong with the path in its parts (`DottedPathError`, `ModuleImportError`,
`AttributeLookupError`), each carrying the import's or the lookup's own exception as `__cause__`, for a caller that
words its own message; `import_dotted` raises those own exceptions as they are.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any


class DottedPathError(ValueError):
    """The text is not a dotted path: one name, an empty name between the dots, nothing before or after a colon."""


class ModuleImportError(ImportError):
    """The path's module did not import. `module` names it: the first module on the way that did not finish
    importing (the colon form: the module as written); when no prefix of a colon-less path is a module at all
    (`found` False), every name but the last. `__cause__` is the import's own exception."""

    def __init__(self, path: str, module: str, found: bool = True) -> None:
        super().__init__(f"cannot import module {module!r} of {path!r}")
        self.module, self.found = module, found


class AttributeLookupError(AttributeError):
    """`owner` (reached as the dotted `walked`) has no attribute `attr`; `__cause__` is getattr's AttributeError."""

    def __init__(self, path: str, owner: Any, walked: str, attr: str) -> None:
        super().__init__(f"{walked!r} has no attribute {attr!r} ({path!r})")
        self.owner, self.walked, self.attr = owner, walked, attr


def load_dotted(path: str) -> Any:
    """The object `path` names (see the module docstring for the forms and the errors)."""
    module_name, colon, attr_path = path.partition(":")
    if colon:
        attrs = attr_path.split(".")
        if not module_name or not all(attrs):
            raise DottedPathError(path)
        try:
            obj: Any = importlib.import_module(module_name)
        except Exception as exc:
            raise ModuleImportError(path, module_name) from exc
    else:
        module_name, obj, attrs = _longest_module(path)
    walked = module_name
    for attr in attrs:
        try:
            obj = getattr(obj, attr)
        except AttributeError as exc:
            raise AttributeLookupError(path, obj, walked, attr) from exc
        walked = f"{walked}.{attr}"
    return obj


def import_dotted(path: str) -> Any:
    """The object `path` names; on failure the import's or getattr's own exception (a ModuleNotFoundError of a
    missing dependency, an AttributeError), or an ImportError when `path` is no dotted path to an importable module."""
    try:
        return load_dotted(path)
    except DottedPathError:
        own = None
    except ModuleImportError as exc:
        own = exc.__cause__ if exc.found else None
    except AttributeLookupError as exc:
        own = exc.__cause__
    if own is None:
        raise ImportError(f"cannot import {path!r}: expected a dotted path 'package.module.attr'")
    raise own  # outside the handler: the exception as the import or getattr raised it, its own cause kept


def _longest_module(path: str) -> tuple[str, Any, list[str]]:
    """(module name, module, attribute names) of a colon-less path: the longest prefix that imports."""
    parts = path.split(".")
    if len(parts) < 2 or not all(parts):
        raise DottedPathError(path)
    first_miss: ModuleNotFoundError | None = None
    for cut in range(len(parts) - 1, 0, -1):
        candidate = ".".join(parts[:cut])
        try:
            return candidate, importlib.import_module(candidate), parts[cut:]
        except ModuleNotFoundError as exc:
            if exc.name is None or not (candidate == exc.name or candidate.startswith(exc.name + ".")):
                raise ModuleImportError(path, unfinished_module(candidate)) from exc  # a missing dependency
            first_miss = first_miss or exc
        except Exception as exc:
            raise ModuleImportError(path, unfinished_module(candidate)) from exc
    raise ModuleImportError(path, ".".join(parts[:-1]), found=False) from first_miss


def unfinished_module(path: str) -> str:
    """The first module on `path`'s way (its module part, before a colon) that is not imported: the one whose
    import stopped (a failed import is removed from sys.modules)."""
    dotted = path.partition(":")[0]
    parts = dotted.split(".")
    for cut in range(1, len(parts) + 1):
        name = ".".join(parts[:cut])
        if name not in sys.modules:
            return name
    return dotted
