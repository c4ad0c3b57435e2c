"""Resolve a job's arguments: layer, derive, check, then split into per-trainer args.

defaults < recipe < command line < --custom-config-path YAML; then the job's auto values, the
shared rules and the job's own rules; every path made absolute against the working folder
(`miles.config.paths`); then `compute_trainer_configs` / `compute_trainer_args`.
Torch-free: this runs before anything heavy is imported.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles.config.args import CLI, RECIPE, YAML, Args
from miles.config.catalog import FLAGS_BY_DEST
from miles.config.jobs import JOBS, JobSpec, job_spec
from miles.config.layering import ConfigFile, apply_cli, apply_file, load_config_file, parse_override, set_sglang_arg
from miles.config.paths import make_paths_absolute
from miles.config.recipes import find_recipe
from miles.config.resolution import Resolution
from miles.config.rules import SHARED_RULES
from miles.config.trainer_config import TrainerConfig, compute_trainer_args, compute_trainer_configs
from miles.core.errors import ConfigError


@dataclass
class ResolvedJob:
    spec: JobSpec
    args: Args
    trainers: list[TrainerConfig]
    trainer_args: dict[str, Args]
    warnings: list[str] = field(default_factory=list)
    recipe: str | None = None


def resolve(
    job: str | None,
    *,
    cli: Mapping[str, Any] | None = None,
    recipe: str | None = None,
    overrides: Sequence[str] = (),
    sglang: Mapping[str, str] | None = None,
    replay_path: str | None = None,
) -> ResolvedJob:
    """Resolve the args of `job` (None: the recipe's or the YAML's job).

    cli: dest -> raw value for the flags given on the command line (only those).
    sglang: the `--sglang-KEY VALUE` passthrough given on the command line (key in snake_case).
    """
    cli = dict(cli or {})
    recipe_file = _load_recipe(recipe) if recipe else None
    yaml_path = cli.get("custom_config_path")
    yaml_file = load_config_file(Path(yaml_path), str(yaml_path)) if yaml_path else None

    name = job or (recipe_file.job if recipe_file else None) or (yaml_file.job if yaml_file else None)
    if name is None:
        raise ConfigError(f"which job? give --job ({', '.join(JOBS)}) or a recipe that names one")
    spec = job_spec(name)
    for cfg in (recipe_file, yaml_file):
        if cfg is not None:
            _check_file_job(cfg, spec)

    res = Resolution(spec.name)
    if recipe_file is not None:
        apply_file(res, recipe_file, RECIPE)
    apply_cli(res, cli)
    for key, value in (sglang or {}).items():
        set_sglang_arg(res, key, value, CLI, f"--sglang-{key.replace('_', '-')}")
    if replay_path is not None:
        res.set("load_debug_rollout_data", replay_path, CLI)
    for text in overrides:
        parse_override(res, text, spec.trainer_roles, "actor", "--override")
    if yaml_file is not None:
        apply_file(res, yaml_file, YAML)

    _check_flags_fit_job(res, spec)
    spec.resolve_auto_defaults(res)
    for rule in (*SHARED_RULES, *spec.extra_rules):
        rule(res, spec)
    # last, over the derived values too: every path against this working folder, as no actor's is the driver's
    make_paths_absolute(res)

    args = res.to_args()
    trainers = compute_trainer_configs(args)
    trainer_args = {trainer.role: compute_trainer_args(args, trainer) for trainer in trainers}
    return ResolvedJob(
        spec=spec,
        args=args,
        trainers=trainers,
        trainer_args=trainer_args,
        warnings=list(res.warnings),
        recipe=recipe_file.label if recipe_file else None,
    )


def _load_recipe(name_or_path: str) -> ConfigFile:
    info = find_recipe(name_or_path)
    label = f"recipe {info.name}" if info.path.parent.name == "recipes" else str(info.path)
    cfg = load_config_file(info.path, label)
    if cfg.job is not None and cfg.job not in JOBS:
        raise ConfigError(f"{cfg.where('job')}: unknown job {cfg.job!r}; jobs: {', '.join(JOBS)}")
    return cfg


def _check_file_job(cfg: ConfigFile, spec: JobSpec) -> None:
    """A training recipe runs under its own job; eval, rollout-only and replay may reuse any recipe."""
    if cfg.job is None or cfg.job == spec.name or spec.reuses_recipes:
        return
    other = JOBS.get(cfg.job)
    how = f"`miles {other.command}`" if other else f"job {cfg.job!r}"
    raise ConfigError(f"{cfg.where('job')}: this is a {how} recipe, not one for `miles {spec.command}`")


def _check_flags_fit_job(res: Resolution, spec: JobSpec) -> None:
    """A flag typed on the command line that this job does not use is an error naming both.

    Recipes and YAML files are shared between jobs (`miles eval` of a training recipe, or of the YAML
    `inspect-config` wrote for it), so values they carry for another job are kept, unused.
    """
    for dest, flag in FLAGS_BY_DEST.items():
        if flag.dest != dest or flag.jobs is None or spec.name in flag.jobs:
            continue
        if res.source(dest) == CLI:
            users = ", ".join(f"`miles {JOBS[j].command}`" for j in sorted(flag.jobs) if j in JOBS)
            raise ConfigError(f"{flag.option} is for {users}, not `miles {spec.command}`")
