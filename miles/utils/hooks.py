"""Loading user hooks given as dotted import paths (`--*-path` flags). Torch-free.

A path is `package.module.attribute` (the longest importable module prefix is used, so
`pkg.mod.Class.method` works too) or `package.module:attribute` (`miles.utils.dotted`, the one loader). Every
failure is a ConfigError of one line naming the flag and the path. Every function loaded runs under --hook-timeout
(`miles.utils.deadline`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from miles.core.errors import ConfigError
from miles.utils.deadline import timed
from miles.utils.dotted import AttributeLookupError, DottedPathError, ModuleImportError, load_dotted


def exception_line(exc: BaseException) -> str:
    """`Type: the first line of its message` (the type alone for an empty message)."""
    text = str(exc).strip().splitlines()
    detail = text[0] if text else ""
    return f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__


def load_object(path: str, flag: str) -> Any:
    """Import `path` and return the object it names; ConfigError naming `flag` and `path` on failure."""
    text = str(path).strip() if path is not None else ""
    if not text:
        raise ConfigError(f"{flag}: empty import path")
    try:
        return load_dotted(text)
    except DottedPathError:
        raise ConfigError(f"{flag} {text!r}: expected a dotted path 'package.module.name'") from None
    except ModuleImportError as exc:
        cause = exc.__cause__
        assert cause is not None
        raise ConfigError(f"{flag} {text!r}: cannot import module {exc.module!r} ({exception_line(cause)})") from cause
    except AttributeLookupError as exc:
        what = "attribute or submodule" if hasattr(exc.owner, "__path__") else "attribute"
        raise ConfigError(f"{flag} {text!r}: {exc.walked!r} has no {what} {exc.attr!r}") from None


def load_function(path: str, flag: str) -> Callable[..., Any]:
    """The callable named by the dotted `path` (a function, or any callable object)."""
    obj = load_object(path, flag)
    if not callable(obj):
        raise ConfigError(f"{flag} {path!r}: names a {type(obj).__name__}, not a function")
    return timed(obj, f"{flag} {path}")


def load_class(path: str, flag: str) -> type:
    """The class named by the dotted `path`."""
    obj = load_object(path, flag)
    if not isinstance(obj, type):
        raise ConfigError(f"{flag} {path!r}: names a {type(obj).__name__}, not a class")
    return obj
