"""Hooks: every dotted-path flag names something importable, of the right kind, callable the way miles calls it.

A user hook is imported (`miles.utils.hooks.load_object`, the loader the runtime uses; importing your module
may import torch, only here), guarded: what the module prints while it is imported is dropped (it cannot pose as
miles' own output), an exit at import (`sys.exit`, argparse's `parse_args`) or another BaseException is one
problem line, and an import that has not finished after `IMPORT_DEADLINE_S` is one too (Ctrl-C still stops it).

A path inside miles itself is checked without importing it (its module exists and defines the name as a function
or class, read from the source), so the shipped recipes stay torch-free; a name the source binds to a literal is
refused from the source, one bound to another expression is imported. The calls below are the documented ones
(miles.rollout.rollout_hooks, miles.training.custom_hooks, miles.training.methods.custom, miles.rollout.filter_hub,
...).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib.util
import inspect
import os
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from miles.core.errors import ConfigError
from miles.utils.deadline import alarm
from miles.utils.dotted import import_dotted, unfinished_module

if TYPE_CHECKING:
    from miles.config.resolve import ResolvedJob


@dataclass(frozen=True)
class Hook:
    """How miles calls the object a flag names: `call` is the documented signature (for messages); a function
    is called with `positional` arguments plus `keywords`, a class constructed with `positional` arguments."""

    dest: str
    call: str
    positional: int
    keywords: tuple[str, ...] = ()
    is_class: bool = False
    base: str | None = None  # "module:Class" the class must subclass (imported only when the flag is set)


HOOKS: tuple[Hook, ...] = (
    Hook("rollout_function_path", "fn(args, rollout_id, data_source, evaluation=False)", 3, ("evaluation",)),
    Hook("eval_function_path", "fn(args, rollout_id, data_source, evaluation=True)", 3, ("evaluation",)),
    Hook("custom_generate_function_path", "fn(args, microgroup, sampling_params)", 3),
    Hook("custom_rollout_log_function_path", "fn(rollout_id, args, samples, metrics, rollout_time)", 5),
    Hook("custom_eval_rollout_log_function_path", "fn(rollout_id, args, data, metrics)", 4),
    Hook("custom_convert_samples_to_train_data_path", "fn(args, samples)", 2),
    Hook("custom_expand_samples_to_train_pairs_path", "fn(args, samples)", 2),
    Hook("custom_prepare_train_batch_path", "fn(args, pairs)", 2),
    Hook("custom_loss_function_path", "fn(args, batch, model_output)", 3),
    Hook("custom_rm_path", "fn(args, samples)", 2),
    Hook("custom_reward_post_process_path", "fn(args, samples)", 2),
    Hook("dynamic_sampling_filter_path", "fn(args, samples)", 2),
    Hook("rollout_sample_filter_path", "fn(args, data)", 2),
    Hook("buffer_filter_path", "fn(args, rollout_id, buffer, num_samples)", 4),
    Hook("diffusion_step_strategy_path", "fn(args, sample, num_steps, seed)", 4),
    Hook("data_source_path", "Class(args)", 1, is_class=True),
    Hook(
        "model_backend_path",
        "Class(args, family)",
        2,
        is_class=True,
        base="miles.training.model:ModelBackend",
    ),
    Hook(
        "sde_step_backend_path",
        "Class(args)",
        1,
        is_class=True,
        base="miles.sampling.sde_backends:SdeStepBackend",
    ),
)
GOLD_HOOK = Hook("gold_rm_type", "fn(args, samples)", 2)  # when it is a dotted path, not a built-in type
# checked by their own loaders (not plain hooks)
SPECIAL = ("train_pipeline_config_path",)

IMPORT_DEADLINE_S = 60.0  # a hook module that has not finished importing by then is refused


def _flag(dest: str) -> str:
    from miles.config.catalog import FLAGS_BY_DEST

    return FLAGS_BY_DEST[dest].option


def check_hooks(resolved: ResolvedJob) -> list[str]:
    """One line per hook flag whose object cannot be imported, is of the wrong kind or takes other arguments."""
    args = resolved.args
    problems = []
    for hook in HOOKS:
        path = getattr(args, hook.dest, None)
        if not path or _is_stock(hook, str(path).strip()):
            continue
        try:
            check_hook(hook, str(path).strip(), _flag(hook.dest))
        except ConfigError as exc:
            problems.append(str(exc))
    gold = args.gold_rm_type
    if gold and "." in str(gold):  # --gold-rm-type names a reward function (else a built-in type)
        try:
            check_hook(GOLD_HOOK, str(gold).strip(), _flag("gold_rm_type"))
        except ConfigError as exc:
            problems.append(str(exc))
    path = args.train_pipeline_config_path
    if path:
        try:
            check_pipeline_config(str(path).strip(), _flag("train_pipeline_config_path"))
        except ConfigError as exc:
            problems.append(str(exc))
    return problems


def check_pipeline_config(path: str, flag: str) -> None:
    """`--train-pipeline-config-path`: importable (guarded, as hooks are), then a TrainPipelineConfig."""
    from miles.models.families import load_user_pipeline_config

    import_hook_object(path, flag)  # a missing module is named as such, an exit or a hang at import is caught
    load_user_pipeline_config(path, flag)


def _is_stock(hook: Hook, path: str) -> bool:
    """The built-in rollout named by its reference path: "no hook"."""
    if hook.dest not in ("rollout_function_path", "eval_function_path"):
        return False
    from miles.config.backends import is_builtin_rollout

    return is_builtin_rollout(path)


def check_hook(hook: Hook, path: str, flag: str) -> None:
    """ConfigError (one line: flag, path, what is wrong, the documented call) unless `path` fits `hook`."""
    if path.startswith("miles.") and ":" not in path and _check_miles_path(hook, path, flag):
        return
    check_object(hook, path, flag, import_hook_object(path, flag))


def check_object(hook: Hook, path: str, flag: str, obj: Any) -> None:
    """ConfigError unless the imported `obj` is of the kind `hook` names and takes its call."""
    if hook.is_class:
        if not isinstance(obj, type):
            raise ConfigError(f"{flag} {path!r}: names a {type(obj).__name__}, not a class; expected {hook.call}")
        if hook.base is not None:
            module, _, name = hook.base.partition(":")
            if not issubclass(obj, import_dotted(hook.base)):
                raise ConfigError(f"{flag} {path!r}: {obj.__name__} is not a subclass of {module}.{name}")
    elif not callable(obj):
        raise ConfigError(f"{flag} {path!r}: names a {type(obj).__name__}, not a function; expected {hook.call}")
    problem = _call_problem(obj, hook)
    if problem:
        raise ConfigError(f"{flag} {path!r}: {problem}; miles calls {hook.call}")


def _call_problem(obj: Any, hook: Hook) -> str | None:
    """Why `obj` cannot be called as `hook` says (None: it can, or its signature cannot be read)."""
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    try:
        signature.bind(*range(hook.positional), **dict.fromkeys(hook.keywords))
    except TypeError as exc:
        name = getattr(obj, "__name__", type(obj).__name__)
        return f"{name}{signature} does not take that call ({exc})"
    return None


# ---- importing a hook module, guarded ---------------------------------------------------------------------------
class _ImportTimeout(BaseException):
    """The import deadline passed. A BaseException, so no `except Exception` on the way (in the module, or in the
    loader's search for the module) can swallow it."""


@functools.cache
def _devnull() -> TextIO:
    """One os.devnull file for the process, never closed: a module may keep the stream it saw at import."""
    return open(os.devnull, "r+", encoding="utf-8")


@contextlib.contextmanager
def _silenced() -> Iterator[None]:
    """Drop what the body prints (stdout, stderr, warnings) and give it an empty stdin (`input()` at import fails
    at once instead of waiting on the terminal). A real file, so a module that asks for `fileno()` still imports."""
    null = _devnull()
    saved = sys.stdin, sys.stdout, sys.stderr
    sys.stdin = sys.stdout = sys.stderr = null
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        sys.stdin, sys.stdout, sys.stderr = saved


def import_hook_object(path: str, flag: str, seconds: float | None = None) -> Any:
    """`load_object(path, flag)` (the runtime's loader), its output dropped, under a deadline (default
    `IMPORT_DEADLINE_S`); an exit, a BaseException or the deadline at import is a ConfigError naming `flag` and
    the module. KeyboardInterrupt (Ctrl-C) goes through."""
    from miles.utils.hooks import exception_line, load_object

    limit = IMPORT_DEADLINE_S if seconds is None else seconds
    try:
        with _silenced(), alarm(limit, _ImportTimeout):
            return load_object(path, flag)
    except (KeyboardInterrupt, Exception):
        raise  # Ctrl-C; a ConfigError of the loader (an Exception at import is one already)
    except _ImportTimeout:
        raise ConfigError(
            f"{flag} {path!r}: importing {unfinished_module(path)!r} did not finish within {limit:g} s; a module "
            "must not wait at import (on a server, a lock, input()): do that inside the function"
        ) from None
    except SystemExit as exc:
        raise ConfigError(
            f"{flag} {path!r}: cannot import module {unfinished_module(path)!r} ({exception_line(exc)}); it exits "
            "when imported (sys.exit, or argparse's parse_args at module level): move that under "
            '`if __name__ == "__main__":`'
        ) from None
    except BaseException as exc:  # GeneratorExit, a BaseException subclass of the module's own
        raise ConfigError(
            f"{flag} {path!r}: cannot import module {unfinished_module(path)!r} ({exception_line(exc)})"
        ) from None


# ---- paths inside miles: read the source, import only what the source cannot tell ------------------------------
def _module_tree(module: str) -> ast.Module | None:
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    return ast.parse(Path(spec.origin).read_text(encoding="utf-8"), filename=spec.origin)


def _names(body: list[ast.stmt]) -> dict[str, ast.AST]:
    """The names a module or class body defines (the last binding wins): functions, classes, assignments
    (`a, b = ...` too), imports, and whatever an `if`/`try`/`with`/loop block binds (that block is the node: only
    running the module tells which binding holds)."""
    names: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                names.update(dict.fromkeys(_target_names(target), node))
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names[alias.asname or alias.name.partition(".")[0]] = node
        elif isinstance(node, _BLOCKS):
            names.update(dict.fromkeys(_bound_inside(node), node))
    return names


_BLOCKS = (ast.If, ast.Try, ast.TryStar, ast.With, ast.AsyncWith, ast.For, ast.AsyncFor, ast.While, ast.Match)


def _target_names(target: ast.expr) -> list[str]:
    """The names an assignment target binds: `a`, `a, b`, `[a, *b]`."""
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, ast.Starred):
        return _target_names(target.value)
    if isinstance(target, (ast.Tuple, ast.List)):
        return [name for item in target.elts for name in _target_names(item)]
    return []


def _bound_inside(block: ast.stmt) -> set[str]:
    """The names a compound statement binds at the level of the body it sits in (not inside its functions)."""
    names: set[str] = set()
    stack: list[ast.AST] = [block]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            continue  # its own body is another namespace
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.alias):
            names.add(node.asname or node.name.partition(".")[0])
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
        if not isinstance(node, ast.Lambda):
            stack.extend(ast.iter_child_nodes(node))
    return names


def _check_miles_path(hook: Hook, path: str, flag: str) -> bool:
    """A path inside miles: the longest prefix that is a module, then each attribute defined in its source.
    True: settled from the source; False: the name is bound by an expression only importing tells (the caller
    imports the module)."""
    parts = path.split(".")
    for cut in range(len(parts) - 1, 1, -1):
        module, attrs = ".".join(parts[:cut]), parts[cut:]
        tree = _module_tree(module)
        if tree is not None:
            break
    else:
        raise ConfigError(f"{flag} {path!r}: miles has no module {'.'.join(parts[:-1])!r}; expected {hook.call}")
    node: ast.AST = tree
    walked = module
    for attr in attrs:
        body = getattr(node, "body", None)
        found = _names(body).get(attr) if isinstance(body, list) else None
        if found is None:
            if isinstance(node, _ASSIGNMENTS):
                return False  # an attribute of an assigned object: importing tells
            inherited = isinstance(node, ast.ClassDef) and bool(node.bases)
            if inherited or not isinstance(node, (ast.Module, ast.ClassDef)):
                return True  # inherited, or an attribute of an imported object: the runtime resolves it
            raise ConfigError(f"{flag} {path!r}: {walked!r} has no attribute {attr!r}; expected {hook.call}")
        if isinstance(found, _BLOCKS):
            return False  # bound inside an if/try block: importing tells which binding holds
        node, walked = found, f"{walked}.{attr}"
    if isinstance(node, _ASSIGNMENTS):
        literal = _literal_type(tree, node, attrs[0]) if len(attrs) == 1 else None
        if literal is None:
            return False  # bound to an expression (`X = make()`, `X = 1 << 20`): import the module
        expected = "class" if hook.is_class else "function"
        raise ConfigError(f"{flag} {path!r}: names a {literal}, not a {expected}; expected {hook.call}")
    if hook.is_class and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise ConfigError(f"{flag} {path!r}: names a function, not a class; expected {hook.call}")
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not hook.is_class and len(attrs) == 1:
        problem = _ast_call_problem(node.args, hook)
        if problem:
            raise ConfigError(f"{flag} {path!r}: {problem}; miles calls {hook.call}")
    return True


_ASSIGNMENTS = (ast.Assign, ast.AnnAssign, ast.AugAssign)


def _literal_type(tree: ast.Module, node: ast.stmt, name: str) -> str | None:
    """The type name of the literal a module-level assignment binds to `name` (`int`, `str`, ...), when the
    module binds `name` nowhere else; None when only running the module tells (an expression, another binding)."""
    value = _assigned_value(node, name)
    if value is None:
        return None
    try:
        literal = ast.literal_eval(value)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None
    return type(literal).__name__ if _bindings(tree, name) == 1 else None


def _assigned_value(node: ast.stmt, name: str) -> ast.expr | None:
    """The expression `node` assigns to `name`: the value of `name = v` or `x: T = v`, the matching item of
    `a, name = (u, v)`; None for anything else (an augmented or starred assignment, an unpacked expression)."""
    if isinstance(node, ast.AnnAssign):
        return node.value
    if not isinstance(node, ast.Assign):
        return None
    for target in node.targets:
        if isinstance(target, ast.Name) and target.id == name:
            return node.value
        if isinstance(target, (ast.Tuple, ast.List)) and isinstance(node.value, (ast.Tuple, ast.List)):
            items = target.elts
            if len(items) == len(node.value.elts) and not any(isinstance(i, ast.Starred) for i in items):
                for item, value in zip(items, node.value.elts, strict=True):
                    if isinstance(item, ast.Name) and item.id == name:
                        return value
    return None


def _bindings(tree: ast.Module, name: str) -> int:
    """How many statements or expressions anywhere in `tree` bind `name` (assignments, defs, imports, globals)."""
    return sum(_binds(node, name) for node in ast.walk(tree))


def _binds(node: ast.AST, name: str) -> bool:
    if isinstance(node, ast.Name):
        return isinstance(node.ctx, ast.Store) and node.id == name
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name == name
    if isinstance(node, ast.alias):
        return (node.asname or node.name.partition(".")[0]) == name
    return isinstance(node, ast.Global) and name in node.names


def _ast_call_problem(params: ast.arguments, hook: Hook) -> str | None:
    positional = [*params.posonlyargs, *params.args]
    required = len(positional) - len(params.defaults)
    n = hook.positional
    if n < required:
        return f"it needs {required} positional arguments, miles passes {n}"
    if n > len(positional) and params.vararg is None:
        return f"it takes {len(positional)} positional arguments, miles passes {n}"
    names = {p.arg for p in positional[n:]} | {p.arg for p in params.kwonlyargs}
    missing = [k for k in hook.keywords if k not in names and params.kwarg is None]
    if missing:
        return f"it takes no {', '.join(missing)}= argument"
    required_kw = [p.arg for p, d in zip(params.kwonlyargs, params.kw_defaults, strict=True) if d is None]
    if required_kw:
        return f"it needs keyword arguments {', '.join(required_kw)} that miles does not pass"
    return None
