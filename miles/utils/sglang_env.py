"""The sglang environment, as the config rules and the engines see it (torch-free, no import of the engine package).

resolve_sglang_python  the interpreter of the sglang environment (`--sglang-python`, `$MILES_SGLANG_PYTHON`,
                       the environment `scripts/build_sglang_env.sh` builds, or this one if it has sglang)
gpus_present           whether this machine has NVIDIA GPUs to give engines
actors_per_node        `$MILES_HTTP_POST_ACTORS_PER_NODE`, the poster actors per node of --use-distributed-post
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

DEFAULT_ENV = Path.home() / ".cache" / "miles" / "sglang-env"
PYTHON_ENV_VAR = "MILES_SGLANG_PYTHON"
ACTORS_PER_NODE_VAR = "MILES_HTTP_POST_ACTORS_PER_NODE"


def resolve_sglang_python(explicit: str | None) -> str | None:
    """The sglang environment's interpreter, or None when none is installed (or `explicit` is no file)."""
    if explicit:
        return explicit if Path(explicit).is_file() else None
    for candidate in (os.environ.get(PYTHON_ENV_VAR), str(DEFAULT_ENV / "bin" / "python")):
        if candidate and Path(candidate).is_file():
            return candidate
    import importlib.util
    import sys

    if importlib.util.find_spec("sglang") is not None:  # `pip install 'miles[sglang]'` on a GPU machine
        return sys.executable
    return None


def gpus_present() -> bool:
    """Whether this machine has NVIDIA GPUs to give engines (torch-free)."""
    import shutil

    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return False
    return Path("/dev/nvidia0").exists() or shutil.which("nvidia-smi") is not None


def actors_per_node(environ: Mapping[str, str] | None = None) -> int:
    """Poster actors per node: $MILES_HTTP_POST_ACTORS_PER_NODE (a positive integer), default 1."""
    env = os.environ if environ is None else environ
    text = env.get(ACTORS_PER_NODE_VAR, "").strip()
    if not text:
        return 1
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"${ACTORS_PER_NODE_VAR} must be a positive integer, got {text!r}")
    return int(text)
