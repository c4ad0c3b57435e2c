"""Every path in a resolved job made absolute against the driver's working folder, before any actor reads it.

A job that joins a running Ray cluster (`$RAY_ADDRESS`) runs its actors in each raylet's own working folder, so a
relative `--save ckpt` would land there, on whichever host the rank runs on. The last step of the resolution
(`miles.config.resolve.resolve`) rewrites every path flag, every trainer's override of one and the derived
`inputs`, against `os.getcwd()` (`~` expanded, the path normalised as `os.path.abspath` does).

What counts as a path is decided per flag, in `PATH_RULES`:

    OUTPUT    a folder or file the job writes or reads: always absolute
    TEMPLATE  a path template (`dump/{rollout_id}.pt`): absolute, its placeholders kept
    DATA      a data file, or a built-in data set name (`digits:test`), which is kept
    MODEL     a local folder or file, a built-in model name (`tiny-sd3`) or a Hugging Face id (`org/name`): an id
              that is not a folder relative to the working folder is kept, as is every built-in name

A URL (`https://...`, `hf://...`) is kept as written everywhere (the preflight refuses it as the user wrote it),
and so is an empty value. Hooks are dotted import paths (`pkg.mod.fn`, `pkg.mod:fn`), never files: they are not
paths here. Torch-free.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from miles.builtin.names import is_builtin_dataset, is_builtin_model
from miles.models.hub_cache import looks_like_hub_id

if TYPE_CHECKING:
    from miles.config.resolution import Resolution

OUTPUT = "output"
TEMPLATE = "template"
DATA = "data"
MODEL = "model"

# dest -> how its value is a path; a NAMED_PATHS flag's rule applies to each of its paths
PATH_RULES: dict[str, str] = {
    "custom_config_path": OUTPUT,
    "output_dir": OUTPUT,
    "hf_checkpoint": MODEL,
    "sglang_python": OUTPUT,
    "prompt_data": DATA,
    "sft_encoder_checkpoint": MODEL,
    "eval_prompt_data": DATA,
    "eval_config": OUTPUT,
    "pickscore_model_path": MODEL,
    "pickscore_processor_path": MODEL,
    "clip_score_model_path": MODEL,
    "clip_score_processor_path": MODEL,
    "dino_model_path": MODEL,
    "aesthetic_model_path": OUTPUT,  # a weights file, read from disk only
    "aesthetic_clip_path": MODEL,
    "hps_model_path": OUTPUT,  # a weights file
    "hps_tokenizer_path": MODEL,
    "image_reward_model_path": OUTPUT,  # a weights file
    "image_reward_tokenizer_path": MODEL,
    "save": OUTPUT,
    "load": OUTPUT,
    "wandb_dir": OUTPUT,
    "tensorboard_dir": OUTPUT,
    "miles_dashboard_workspace": OUTPUT,
    "save_debug_rollout_data": TEMPLATE,
    "load_debug_rollout_data": TEMPLATE,
    "save_debug_train_data": TEMPLATE,
    "dump_details": OUTPUT,
    "teacher_checkpoint": MODEL,
    # not a flag: the built-in names' places under $MILES_HOME (`miles.config.rules.inputs`), {name: path}
    "inputs": OUTPUT,
}

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def absolute_path(value: str | os.PathLike[str], rule: str, cwd: str) -> str:
    """`value` made absolute against `cwd` where `rule` says it is a path (see the module docstring)."""
    text = os.fspath(value)
    if not text or _URL.match(text):
        return text
    if rule == DATA and is_builtin_dataset(text):
        return text
    if rule == MODEL and (is_builtin_model(text) or _hub_id(text, cwd)):
        return text
    return os.path.normpath(os.path.join(cwd, os.path.expanduser(text)))


def _hub_id(text: str, cwd: str) -> bool:
    """A Hugging Face id (`org/name`, `name`) with no folder or file of that name in `cwd`."""
    return looks_like_hub_id(text) and not os.path.lexists(os.path.join(cwd, text))


def absolute_value(value: Any, rule: str, cwd: str) -> Any:
    """A flag's value with its paths absolute: a path, or a {name: path} mapping (NAMED_PATHS, `inputs`)."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        return {name: absolute_value(path, rule, cwd) for name, path in value.items()}
    if isinstance(value, (str, os.PathLike)):
        return absolute_path(value, rule, cwd)
    return value


def make_paths_absolute(res: Resolution, cwd: str | None = None) -> None:
    """Rewrite every path of `res` (the job's values and each trainer's overrides) against `cwd` (default: this
    process's working folder), keeping every value's source."""
    cwd = os.path.abspath(cwd if cwd is not None else os.getcwd())
    for dest, rule in PATH_RULES.items():
        value = res[dest]
        absolute = absolute_value(value, rule, cwd)
        if absolute != value:
            res.set(dest, absolute, res.source(dest))
    for overrides in res.trainer_overrides.values():
        for dest, value in overrides.items():
            rule = PATH_RULES.get(dest)
            if rule is not None:
                overrides[dest] = absolute_value(value, rule, cwd)
