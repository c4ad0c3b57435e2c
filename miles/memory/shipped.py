"""The real-size configs miles ships, the recipes that use them, and their `counts.json`.

`python -m miles.memory.shipped` re-measures every shipped config folder (seconds each, no weights) for the
denoiser components and LoRA targets of the family's defaults and of every shipped recipe on that checkpoint,
and writes `counts.json` next to the configs, then traces every step the shipped recipes' memory plans ask for
(with the changes a refusal computes) into `traces.json`, so `miles plan` needs no torch for a shipped recipe.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles.memory.config_dirs import COUNTS_FILE, shipped_config_dir, shipped_config_dirs


@dataclass
class ShippedModel:
    family: Any
    config_dir: Path
    components: tuple[str, ...] = ("transformer",)
    targets: list[tuple[str, ...]] = field(default_factory=list)
    recipes: list[str] = field(default_factory=list)


def shipped_recipes() -> Iterator[tuple[str, Any, Path]]:
    """(recipe name, resolved job, shipped config dir) of every shipped recipe whose checkpoint miles ships
    real-size configs for (the GPU recipes; the tiny CPU recipes build their own checkpoints)."""
    from miles.config.recipes import shipped_recipes as recipe_files
    from miles.config.resolve import resolve
    from miles.models.families import resolve_family

    for name in sorted(recipe_files()):
        resolved = resolve(None, recipe=name)
        args = resolved.args
        if not args.hf_checkpoint:
            continue
        family = resolve_family(args.hf_checkpoint, args.diffusion_model_family, args.train_pipeline_config_path)
        config_dir = shipped_config_dir(family, str(args.hf_checkpoint))
        if config_dir is not None:
            yield name, resolved, config_dir


def shipped_models() -> dict[Path, ShippedModel]:
    from miles.memory.static import lora_targets
    from miles.models.families import get_family, registered_families
    from miles.models.pipeline_config import target_components

    models: dict[Path, ShippedModel] = {}
    for key in registered_families():
        family = get_family(key)
        for config_dir in shipped_config_dirs(family):
            components = family.denoiser_components(family.experts or ("transformer",))
            models[config_dir] = ShippedModel(family, config_dir, components, [tuple(family.lora_target_modules)])
    for name, resolved, config_dir in shipped_recipes():
        model = models[config_dir]
        model.recipes.append(name)
        for role_args in resolved.trainer_args.values():
            components = model.family.denoiser_components(target_components(role_args.update_weight_target_module))
            if components != model.components:
                raise ValueError(f"recipe {name}: trains {components}, the shipped counts cover {model.components}")
            targets = lora_targets(role_args, model.family)
            if role_args.use_lora and targets not in model.targets:
                model.targets.append(targets)
    return models


def write_shipped_counts() -> list[Path]:
    from miles.memory.cache import write_counts
    from miles.memory.measure import measure

    written = []
    for config_dir, model in sorted(shipped_models().items()):
        counts = measure(config_dir, model.family, model.components, model.targets)
        write_counts(config_dir / COUNTS_FILE, counts)
        written.append(config_dir / COUNTS_FILE)
    return written


def shipped_trace_specs() -> dict[Path, tuple[Any, list[Any]]]:
    """{config dir: (family, specs)} of every trace the shipped recipes' memory plans ask for, with the changes a
    refusal computes (each recipe planned against a 1 GiB GPU, so that every change is tried)."""
    from miles.config.resolve import resolve
    from miles.memory import step
    from miles.memory.estimate import candidate_changes, estimate_memory, fit_changes
    from miles.placement.cluster import flags_cluster
    from miles.placement.plan import make_plan

    step.record_traces(True)
    try:
        for name, resolved, _ in shipped_recipes():
            estimate = estimate_memory(resolved)
            estimate.capacity_gib = 1.0

            def again(extra: Any, name: str = name) -> Any:
                return resolve(None, recipe=name, cli=dict(extra))

            def plan_for(r: Any) -> Any:
                return make_plan(r.args, flags_cluster(r.args), r.spec)

            fit_changes(estimate, again, candidate_changes(resolved), plan_for)
        out: dict[Path, tuple[Any, list[Any]]] = {}
        for config_dir, family, spec in step.RECORDED:
            entry = out.setdefault(config_dir, (family, []))
            if spec not in entry[1]:
                entry[1].append(spec)
        return out
    finally:
        step.record_traces(False)


def write_shipped_traces() -> list[Path]:
    from miles.memory.step import write_shipped_traces as write

    return [write(d, family, specs) for d, (family, specs) in sorted(shipped_trace_specs().items())]


if __name__ == "__main__":  # pragma: no cover - a maintenance command
    import sys

    if "--traces-only" not in sys.argv:
        for path in write_shipped_counts():
            print(path)
    for path in write_shipped_traces():
        print(path)
