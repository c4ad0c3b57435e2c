"""Hooks: every dotted-path flag names something importable, of the right kind, callable the way miles calls it.

A user hook is imported (`miles.utils.hooks.load_object`, the loader the runtime uses; importing your module
may import torch, only here); a path inside miles itself is checked without importing it (its module exists and
defines the name, read from the source), so the shipped recipes stay torch-free. The calls below are the
documented ones (miles.rollout.rollout_hooks, miles.training.custom_hooks, miles.rollout.filter_hub, ...).
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles.config.errors import ConfigError

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
        base="miles.rollout.sde_backends:SdeStepBackend",
    ),
)
# checked by their own loaders (not plain hooks)
SPECIAL = ("train_pipeline_config_path",)


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
    path = getattr(args, "train_pipeline_config_path", None)
    if path:
        from miles.models.families import load_user_pipeline_config

        try:
            load_user_pipeline_config(str(path))
        except ConfigError as exc:
            problems.append(str(exc))
    return problems


def _is_stock(hook: Hook, path: str) -> bool:
    """The built-in rollout named by its reference path: "no hook"."""
    if hook.dest not in ("rollout_function_path", "eval_function_path"):
        return False
    from miles.rollout.rollout_hooks import is_builtin_rollout

    return is_builtin_rollout(path)


def check_hook(hook: Hook, path: str, flag: str) -> None:
    """ConfigError (one line: flag, path, what is wrong, the documented call) unless `path` fits `hook`."""
    if path.startswith("miles.") and ":" not in path:
        _check_miles_path(hook, path, flag)
        return
    from miles.utils.hooks import load_object

    obj = load_object(path, flag)
    if hook.is_class:
        if not isinstance(obj, type):
            raise ConfigError(f"{flag} {path!r}: names a {type(obj).__name__}, not a class; expected {hook.call}")
        if hook.base is not None:
            module, _, name = hook.base.partition(":")
            base = getattr(importlib.import_module(module), name)
            if not issubclass(obj, base):
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


# ---- paths inside miles: read the source, import nothing ------------------------------------------------------
def _module_tree(module: str) -> ast.Module | None:
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    return ast.parse(Path(spec.origin).read_text(encoding="utf-8"), filename=spec.origin)


def _names(body: list[ast.stmt]) -> dict[str, ast.AST]:
    """The names a module or class body defines: functions, classes, assignments, imports."""
    names: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    names[target.id] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names[alias.asname or alias.name.partition(".")[0]] = node
    return names


def _check_miles_path(hook: Hook, path: str, flag: str) -> None:
    """A path inside miles: the longest prefix that is a module, then each attribute defined in its source."""
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
            inherited = isinstance(node, ast.ClassDef) and bool(node.bases)
            if inherited or not isinstance(node, (ast.Module, ast.ClassDef)):
                return  # inherited, or an attribute of an assigned or imported object: the runtime resolves it
            raise ConfigError(f"{flag} {path!r}: {walked!r} has no attribute {attr!r}; expected {hook.call}")
        node, walked = found, f"{walked}.{attr}"
    if hook.is_class and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise ConfigError(f"{flag} {path!r}: names a function, not a class; expected {hook.call}")
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not hook.is_class and len(attrs) == 1:
        problem = _ast_call_problem(node.args, hook)
        if problem:
            raise ConfigError(f"{flag} {path!r}: {problem}; miles calls {hook.call}")


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
