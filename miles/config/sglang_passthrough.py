"""The `--sglang-KEY VALUE` passthrough to the rollout engine's own server arguments.

Keys are kept as a mapping (`args.sglang_args`). Where sglang is importable the key is checked
against its server arguments; keys miles sets itself are refused everywhere.
"""

from __future__ import annotations

import functools
import importlib.util

from miles.config.flags import closest
from miles.core.errors import ConfigError

# Server arguments miles sets itself for every engine it launches.
MILES_OWNED = frozenset({"model_path", "host", "port", "base_gpu_id", "random_seed", "num_gpus"})
# Server arguments miles sets from one of its flags, which also sets the trainer's side of the same thing.
FROM_FLAG = {"flow_shift": "--diffusion-flow-shift"}


def check_sglang_key(key: str, where: str) -> None:
    if key in FROM_FLAG:
        raise ConfigError(
            f"{where}: --sglang-{key.replace('_', '-')} is set by miles from {FROM_FLAG[key]}, which the in-process "
            f"engine and the trainer's schedule follow too; use {FROM_FLAG[key]}"
        )
    if key in MILES_OWNED:
        raise ConfigError(f"{where}: --sglang-{key.replace('_', '-')} is set by miles itself for each engine")
    known = sglang_server_args()
    if known is not None and key not in known:
        hint = closest(key, known)
        suffix = f" (did you mean --sglang-{hint.replace('_', '-')}?)" if hint else ""
        raise ConfigError(f"{where}: sglang has no server argument {key!r}{suffix}")


@functools.cache
def sglang_server_args() -> frozenset[str] | None:
    """Field names of sglang-diffusion's ServerArgs, or None when sglang is not installed."""
    if importlib.util.find_spec("sglang") is None:
        return None
    import dataclasses

    for module_name in ("sglang.multimodal_gen.runtime.server_args", "sglang.srt.server_args"):
        try:
            module = importlib.import_module(module_name)
        except Exception:
            continue
        server_args = getattr(module, "ServerArgs", None)
        if server_args is not None and dataclasses.is_dataclass(server_args):
            return frozenset(f.name for f in dataclasses.fields(server_args))
    return None
