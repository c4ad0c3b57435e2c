"""Loading user hooks given as dotted import paths (`--*-path` flags). Torch-free.

A path is `package.module.attribute` (the longest importable module prefix is used, so
`pkg.mod.Class.method` works too) or `package.module:attribute`. Every failure is a ConfigError
of one line naming the flag and the path. Every function loaded runs under --hook-timeout
(`miles.utils.deadline`).
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from typing import Any

from miles.core.errors import ConfigError
from miles.utils.deadline import timed


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    detail = text[0] if text else ""
    return f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__


def load_object(path: str, flag: str) -> Any:
    """Import `path` and return the object it names; ConfigError naming `flag` and `path` on failure."""
    text = str(path).strip() if path is not None else ""
    if not text:
        raise ConfigError(f"{flag}: empty import path")
    if ":" in text:
        module_name, _, attr_path = text.partition(":")
        attrs = attr_path.split(".") if attr_path else []
    else:
        parts = text.split(".")
        if len(parts) < 2:
            raise ConfigError(f"{flag} {text!r}: expected a dotted path 'package.module.name'")
        # The longest importable module prefix: `a.b.c.d` tries `a.b.c`, then `a.b`, then `a`.
        module_name, attrs = ".".join(parts[:-1]), parts[-1:]
        for cut in range(len(parts) - 1, 0, -1):
            candidate = ".".join(parts[:cut])
            try:
                found = importlib.util.find_spec(candidate) is not None
            except Exception:  # a missing or broken parent package: the import below reports it
                found = False
            if found:
                module_name, attrs = candidate, parts[cut:]
                break
    if not module_name or not attrs or any(not a for a in attrs):
        raise ConfigError(f"{flag} {text!r}: expected a dotted path 'package.module.name'")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:
        raise ConfigError(f"{flag} {text!r}: cannot import module {module_name!r} ({_one_line(exc)})") from exc
    walked = module_name
    for attr in attrs:
        try:
            obj = getattr(obj, attr)
        except AttributeError:
            what = "attribute or submodule" if hasattr(obj, "__path__") else "attribute"
            raise ConfigError(f"{flag} {text!r}: {walked!r} has no {what} {attr!r}") from None
        walked = f"{walked}.{attr}"
    return obj


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
