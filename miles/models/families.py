"""The model-family registry: `TrainPipelineConfig` classes keyed by family name.

Torch-free at import (the config validator calls `resolve_family` before torch is loaded).
Resolution order, first hit wins:
  1. `--diffusion-model-family KEY`
  2. `--train-pipeline-config-path pkg.mod.Class` (a user subclass or instance; excludes 1.)
  3. the env var `MILES_DIFFUSION_MODEL_FAMILY`
  4. the `--hf-checkpoint` name, matched against each family's `hf_ckpt_name_patterns`
  5. for a local directory whose name carries no hint: its `model_index.json`, scored by each family's
     `model_index_score` (by default: its `_class_name` against the family's `pipeline_class`)
New families register with `@register_train_pipeline_config("key")`.
"""

from __future__ import annotations

import difflib
import importlib
import json
import os
import re
from collections.abc import Mapping
from pathlib import PurePath
from typing import Any

from miles.core.errors import ConfigError
from miles.models.pipeline_config import TrainPipelineConfig
from miles.utils.dotted import import_dotted

FAMILY_ENV = "MILES_DIFFUSION_MODEL_FAMILY"
FAMILY_FLAG = "--diffusion-model-family"
CONFIG_PATH_FLAG = "--train-pipeline-config-path"
CHECKPOINT_FLAG = "--hf-checkpoint"

_REGISTRY: dict[str, type[TrainPipelineConfig]] = {}
_BUILTIN_MODULES = (
    "miles.models.sd3.config",
    "miles.models.flux.config",
    "miles.models.flux_kontext.config",
    "miles.models.flux2.config",
    "miles.models.z_image.config",
    "miles.models.qwen_image.config",
    "miles.models.qwen_image_edit.config",
    "miles.models.wan2_2.config",
    "miles.models.wan2_2_i2v.config",
    "miles.models.wan2_2_ti2v.config",
    "miles.models.ltx.config",
    "miles.models.cosmos3.config",
)
_builtins_loaded = False


def register_train_pipeline_config(key: str):
    """Class decorator: register a `TrainPipelineConfig` subclass under `key` (sets its `name`)."""

    def decorator(cls: type[TrainPipelineConfig]) -> type[TrainPipelineConfig]:
        if not (isinstance(cls, type) and issubclass(cls, TrainPipelineConfig)):
            raise TypeError(f"@register_train_pipeline_config({key!r}) needs a TrainPipelineConfig subclass")
        existing = _REGISTRY.get(key)
        if existing is not None and existing.__qualname__ != cls.__qualname__:
            raise ValueError(f"model family {key!r} is already registered by {existing.__qualname__}")
        cls.name = key
        _REGISTRY[key] = cls
        return cls

    return decorator


def _ensure_builtins() -> None:
    global _builtins_loaded
    if not _builtins_loaded:
        _builtins_loaded = True
        for module in _BUILTIN_MODULES:
            importlib.import_module(module)


def registered_families() -> tuple[str, ...]:
    """Every registered family key, sorted."""
    _ensure_builtins()
    return tuple(sorted(_REGISTRY))


def trainable_families() -> tuple[str, ...]:
    _ensure_builtins()
    return tuple(k for k in sorted(_REGISTRY) if _REGISTRY[k].trainable)


def normalize_family_key(key: str) -> str:
    """'Qwen-Image' -> 'qwen_image', 'wan2.2' -> 'wan2_2' (case, '-', '.', ' ' are forgiven)."""
    return re.sub(r"[-.\s]+", "_", key.strip().lower())


def family_from_checkpoint_name(name: str) -> str | None:
    """The family whose name patterns best match `name` (its last path component first), else None.

    Raises ConfigError when two families match equally well.
    """
    _ensure_builtins()
    stripped = str(name).rstrip("/\\")
    candidates = [PurePath(stripped).name, stripped] if stripped else []
    for text in candidates:
        scores = {key: cls.match_score(text) for key, cls in _REGISTRY.items()}
        best = max(scores.values(), default=0)
        if best == 0:
            continue
        winners = sorted(k for k, s in scores.items() if s == best)
        if len(winners) > 1:
            raise ConfigError(
                f"{CHECKPOINT_FLAG} {name!r}: the name matches model families {', '.join(winners)} equally; "
                f"pass {FAMILY_FLAG} to choose"
            )
        return winners[0]
    return None


def family_from_model_index(checkpoint: str) -> str | None:
    """The family whose `model_index_score` of a local `model_index.json` is the highest, alone (by default the one
    whose pipeline class is its `_class_name`), else None."""
    _ensure_builtins()
    try:
        with open(os.path.join(os.path.expanduser(checkpoint), "model_index.json")) as f:
            index = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(index, dict):
        return None
    scores = {k: cls.model_index_score(index) for k, cls in _REGISTRY.items()}
    best = max(scores.values(), default=0)
    matches = sorted(k for k, s in scores.items() if s == best)
    return matches[0] if best > 0 and len(matches) == 1 else None


def _suggest(value: str) -> str:
    keys = list(_REGISTRY)
    norm = normalize_family_key(value)
    guess = family_from_checkpoint_name(value) if value.strip() else None
    if guess is None:
        close = difflib.get_close_matches(norm, keys, n=1, cutoff=0.5)
        guess = close[0] if close else None
    return f"did you mean {guess!r}? " if guess else ""


def get_family(key: str, selected_by: str = FAMILY_FLAG) -> TrainPipelineConfig:
    """An instance of the family registered as `key` (normalized); ConfigError naming `selected_by` if unknown."""
    _ensure_builtins()
    cls = _REGISTRY.get(normalize_family_key(key))
    if cls is None:
        raise ConfigError(
            f"{selected_by}: unknown model family {key!r}; {_suggest(key)}"
            f"registered families: {', '.join(registered_families())}"
        )
    return cls()


def load_user_pipeline_config(path: str, selected_by: str = CONFIG_PATH_FLAG) -> TrainPipelineConfig:
    """Import a user `TrainPipelineConfig` subclass (instantiated with no arguments) or instance."""
    try:
        obj: Any = import_dotted(path)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"{selected_by} {path!r}: cannot import it ({type(exc).__name__}: {exc})") from exc
    if isinstance(obj, type) and issubclass(obj, TrainPipelineConfig):
        try:
            return obj()
        except TypeError as exc:
            raise ConfigError(f"{selected_by} {path!r}: cannot instantiate it without arguments ({exc})") from exc
    if isinstance(obj, TrainPipelineConfig):
        return obj
    raise ConfigError(
        f"{selected_by} {path!r}: expected a TrainPipelineConfig subclass or instance, got {type(obj).__name__}"
    )


def resolve_family(
    hf_checkpoint: str | os.PathLike | None,
    family: str | None = None,
    config_path: str | None = None,
    env: Mapping[str, str] | None = None,
    *,
    require_trainable: bool = True,
) -> TrainPipelineConfig:
    """The `TrainPipelineConfig` for a job (see the module docstring for the order).

    `env` defaults to `os.environ`. With `require_trainable`, a registered family without a
    training path is a ConfigError naming what selected it.
    """
    _ensure_builtins()
    env = os.environ if env is None else env
    if family is not None and config_path is not None:
        raise ConfigError(
            f"{FAMILY_FLAG} and {CONFIG_PATH_FLAG} are mutually exclusive: "
            "name a registered family or give your own TrainPipelineConfig"
        )
    checkpoint = None if hf_checkpoint is None else str(hf_checkpoint)
    env_value = (env.get(FAMILY_ENV) or "").strip()
    if family is not None:
        selected_by = f"{FAMILY_FLAG} {family}"
        config = get_family(family, selected_by=FAMILY_FLAG)
    elif config_path is not None:
        selected_by = f"{CONFIG_PATH_FLAG} {config_path}"
        config = load_user_pipeline_config(config_path)
    elif env_value:
        selected_by = f"{FAMILY_ENV}={env_value}"
        config = get_family(env_value, selected_by=f"env {FAMILY_ENV}")
    else:
        key = family_from_checkpoint_name(checkpoint) if checkpoint else None
        if key is None and checkpoint:
            key = family_from_model_index(checkpoint)
        if key is None:
            what = (
                f"{CHECKPOINT_FLAG} {checkpoint!r}: no model family matches this name"
                if checkpoint
                else (f"no {CHECKPOINT_FLAG} to match a model family against")
            )
            raise ConfigError(
                f"{what}; pass {FAMILY_FLAG} (one of {', '.join(registered_families())}) "
                f"or {CONFIG_PATH_FLAG} pkg.module.MyPipelineConfig"
            )
        selected_by = f"{CHECKPOINT_FLAG} {checkpoint!r} (matched family {key!r})"
        config = _REGISTRY[key]()
    if require_trainable:
        config.check_trainable(selected_by, trainable_families())
    return config


def args_family(args: Any, require_trainable: bool = False) -> TrainPipelineConfig:
    """The model family a job's (or a trainer role's) args select: `--diffusion-model-family`, else
    `--train-pipeline-config-path`, else the checkpoint (the resolution order above)."""
    family = args.diffusion_model_family
    if args.train_pipeline_config_path is not None and _derived(args, "diffusion_model_family"):
        family = None  # the name the config matched yields to a pipeline config a trainer's override gives
    return resolve_family(
        args.hf_checkpoint,
        family=family,
        config_path=args.train_pipeline_config_path,
        require_trainable=require_trainable,
    )


def _derived(args: Any, dest: str) -> bool:
    sources = getattr(args, "sources", None)
    return callable(sources) and sources().get(dest) == "derived"
