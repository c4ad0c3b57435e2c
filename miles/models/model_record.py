"""What a rollout was made with: the model family, the checkpoint and a few shape facts of its denoiser.

A rollout file keeps this record (`extra["model"]`, `miles.io.rollout_file`); `miles replay` compares it with
the job's checkpoint before anything starts, so a rollout is never replayed on a model of another family or
shape. Torch-free: the facts come from the denoiser's `config.json` (`<checkpoint>/transformer/config.json`,
or each expert's folder), located without the network (a built-in model's folder, a local directory, or a
snapshot in the local Hugging Face cache).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

# the denoiser config keys that fix the shapes a trajectory has (latent channels, size, patching) and the
# trainer's module (layers, heads): two checkpoints that differ in one of them cannot share a rollout
SHAPE_FACTS = (
    "in_channels",
    "out_channels",
    "sample_size",
    "patch_size",
    "num_layers",
    "num_attention_heads",
    "attention_head_dim",
)


def denoiser_components(family: Any) -> tuple[str, ...]:
    """The pipeline folders of a family's denoiser: its experts, else its transformer subfolder."""
    return tuple(getattr(family, "experts", ()) or (getattr(family, "transformer_subfolder", "transformer"),))


def local_checkpoint_dir(name_or_path: str | os.PathLike) -> Path | None:
    """The local folder of a checkpoint (built-in name, directory, or cached hub snapshot), else None."""
    from miles.builtin.names import builtin_path, is_builtin_model
    from miles.models.hub_cache import cached_snapshot, looks_like_hub_id

    name = str(name_or_path)
    if is_builtin_model(name):
        folder = builtin_path(name)
        return folder if folder.is_dir() else None
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if looks_like_hub_id(name):
        return cached_snapshot(name, lambda snap: (snap / "model_index.json").is_file())
    return None


def read_json_object(path: Path) -> dict[str, Any] | None:
    """A JSON object file, or None when it is absent or not a JSON object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def denoiser_facts(checkpoint_dir: Path, components: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """{component: {fact: value}} for each denoiser component whose config.json is readable."""
    facts: dict[str, dict[str, Any]] = {}
    for component in components:
        config = read_json_object(checkpoint_dir / component / "config.json")
        if config is not None:
            facts[component] = {key: config[key] for key in SHAPE_FACTS if key in config}
    return facts


def model_record(
    checkpoint: str | os.PathLike | None, family_name: str | None = None, config_path: str | None = None
) -> dict[str, Any] | None:
    """`{"family", "checkpoint", "denoiser": {component: facts}}` of a job's checkpoint, or None when its
    family cannot be told (a user TrainPipelineConfig the record does not import, no checkpoint)."""
    from miles.core.errors import ConfigError
    from miles.models.families import resolve_family

    if checkpoint is None or config_path is not None:
        return None
    try:
        family = resolve_family(checkpoint, family=family_name, require_trainable=False)
    except ConfigError:
        return None
    folder = local_checkpoint_dir(checkpoint)
    facts = denoiser_facts(folder, denoiser_components(family)) if folder is not None else {}
    return {"family": family.name, "checkpoint": str(checkpoint), "denoiser": facts}


def model_record_of(args: Any) -> dict[str, Any] | None:
    """The record of the model a job's `args` run (`--hf-checkpoint`, `--diffusion-model-family`)."""
    return model_record(
        args.hf_checkpoint,
        args.diffusion_model_family,
        args.train_pipeline_config_path,
    )


def describe_record(record: dict[str, Any]) -> str:
    """'family sd3, checkpoint tiny-sd3, transformer in_channels 4 sample_size 8 ...' (for messages)."""
    parts = [f"family {record.get('family')}", f"checkpoint {record.get('checkpoint')}"]
    for component, facts in sorted((record.get("denoiser") or {}).items()):
        if isinstance(facts, dict) and facts:
            parts.append(component + " " + " ".join(f"{k} {facts[k]}" for k in SHAPE_FACTS if k in facts))
    return ", ".join(parts)


def record_differences(made_with: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """What differs between two records: the family, then each shape fact both of them know."""
    out: list[str] = []
    if made_with.get("family") != current.get("family"):
        out.append(f"family {made_with.get('family')} vs {current.get('family')}")
    old, new = made_with.get("denoiser") or {}, current.get("denoiser") or {}
    if not isinstance(old, dict) or not isinstance(new, dict):
        return out
    for component in sorted(set(old) & set(new)):
        a, b = old[component], new[component]
        if not isinstance(a, dict) or not isinstance(b, dict):
            continue
        for key in SHAPE_FACTS:
            if key in a and key in b and a[key] != b[key]:
                out.append(f"{component}.{key} {a[key]} vs {b[key]}")
    return out
