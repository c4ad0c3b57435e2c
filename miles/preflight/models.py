"""Model paths: every checkpoint the job reads is a built-in name, a local folder holding what the loader
reads, or a hub id whose snapshot is in the local Hugging Face cache. Nothing touches the network.

A pipeline (`--hf-checkpoint`, `--teacher-checkpoint`) needs `model_index.json`, the folder of every component it
lists, and the denoiser's `config.json` (`transformer/`, or each expert's folder); `--sft-encoder-checkpoint` the
same without the denoiser (SFT loads it with `transformer=None`); the PickScore model a `config.json` and its
processor a processor or tokenizer config.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles.models.hub_cache import cached_snapshot, describe_cache, looks_like_hub_id, snapshots
from miles.models.model_record import denoiser_components, read_json_object
from miles.rewards import REWARD_TYPES

if TYPE_CHECKING:
    from miles.config.jobs import JobSpec
    from miles.config.resolve import ResolvedJob

# a folder's problem (None: it holds what the loader reads)
Layout = Callable[[Path], "str | None"]


def pipeline_layout(denoiser: tuple[str, ...]) -> Layout:
    """A diffusers pipeline folder: model_index.json, its components' folders, `denoiser`'s configs."""

    def problem(folder: Path) -> str | None:
        index = read_json_object(folder / "model_index.json")
        if index is None:
            what = "an unreadable" if (folder / "model_index.json").exists() else "no"
            return f"holds {what} model_index.json; give a diffusers pipeline folder (the one with model_index.json)"
        missing = [
            name
            for name, entry in sorted(index.items())
            if not name.startswith("_")
            and isinstance(entry, list)
            and len(entry) == 2
            and None not in entry
            and name not in denoiser_skip(denoiser)
            and not (folder / name).is_dir()
        ]
        missing += [f"{c}/config.json" for c in denoiser if read_json_object(folder / c / "config.json") is None]
        if missing:
            return f"lacks {', '.join(missing)}; copy or download the whole pipeline again"
        return None

    return problem


def denoiser_skip(denoiser: tuple[str, ...]) -> tuple[str, ...]:
    """Component folders not to look for: the denoiser's (its config.json is checked instead), or, for the SFT
    encoder pipeline (loaded with transformer=None), the transformers'."""
    return denoiser or ("transformer", "transformer_2")


def file_layout(*names: str, what: str) -> Layout:
    """A folder holding one of `names` (a transformers model or processor)."""

    def problem(folder: Path) -> str | None:
        if any((folder / name).is_file() for name in names):
            return None
        return f"holds no {' or '.join(names)} (not a {what} folder)"

    return problem


@dataclass(frozen=True)
class ModelInput:
    """A flag naming a checkpoint, what its folder must hold (`kind`) and the jobs that read it (`applies_to`, read
    from the job's row of the job table; None: every job)."""

    dest: str
    flag: str
    kind: str  # pipeline | encoder | clip_model | clip_processor
    applies_to: Callable[[JobSpec], bool] | None = None
    used: Callable[[Any], bool] = lambda args: True

    def applies(self, job: JobSpec) -> bool:
        return self.applies_to is None or bool(self.applies_to(job))


def _uses_reward(name: str) -> Callable[[Any], bool]:
    """Whether the job scores with reward type `name` (its model paths are then loaded)."""

    def used(args: Any) -> bool:
        from miles.rewards import reward_names

        return name in reward_names(args) and not args.custom_rm_path

    return used


MODEL_INPUTS: tuple[ModelInput, ...] = (
    ModelInput("hf_checkpoint", "--hf-checkpoint", "pipeline"),
    ModelInput("teacher_checkpoint", "--teacher-checkpoint", "pipeline", applies_to=attrgetter("distills")),
    ModelInput(
        "sft_encoder_checkpoint", "--sft-encoder-checkpoint", "encoder", applies_to=attrgetter("trains_on_dataset")
    ),
    *(
        ModelInput(dest, "--" + dest.replace("_", "-"), kind, used=_uses_reward(name))
        for name, reward in REWARD_TYPES.items()
        for dest, kind in reward.model_paths
    ),
)


def _family_denoiser(args: Any, checkpoint: str) -> tuple[str, ...]:
    """The denoiser folders the trainer loads from `checkpoint` (`transformer` when the family is unknown, the
    user class's with --train-pipeline-config-path)."""
    from miles.core.errors import ConfigError
    from miles.models.families import resolve_family

    config_path = args.train_pipeline_config_path
    if config_path:
        from miles.models.families import load_user_pipeline_config

        try:
            return denoiser_components(load_user_pipeline_config(config_path))
        except ConfigError:
            return ()  # the hooks check names it; here only the components model_index.json lists
    try:
        family = resolve_family(checkpoint, family=args.diffusion_model_family, require_trainable=False)
    except ConfigError:
        return ("transformer",)
    return denoiser_components(family)


def layout_for(kind: str, args: Any, value: str) -> Layout:
    if kind == "pipeline":
        return pipeline_layout(_family_denoiser(args, value))
    if kind == "encoder":
        return pipeline_layout(())
    if kind == "clip_model":
        return file_layout("config.json", what="transformers model")
    if kind == "tokenizer":
        return file_layout("tokenizer_config.json", "tokenizer.json", "vocab.json", "vocab.txt", what="tokenizer")
    return file_layout("preprocessor_config.json", "processor_config.json", "tokenizer_config.json", what="processor")


def check_model_paths(resolved: ResolvedJob) -> list[str]:
    """One line per model path that is neither built-in, nor a complete local folder, nor cached; a value
    given to several flags (the teacher defaults to --hf-checkpoint) is one line naming them all."""
    args = resolved.args
    flags: dict[tuple[str, str], list[str]] = {}
    for spec in MODEL_INPUTS:
        value = getattr(args, spec.dest, None)
        if value is None or not spec.used(args) or not spec.applies(resolved.spec):
            continue
        flags.setdefault((str(value), spec.kind), []).append(spec.flag)
    problems = []
    for (value, kind), named in flags.items():
        if kind == "file":  # one weights file (an aesthetic head, an HPS checkpoint)
            path = Path(value).expanduser()
            if not path.is_file():
                what = "is a folder; give the weights file in it" if path.is_dir() else "no such file"
                problems.append(f"{named[0]} {value}: {what}")
            continue
        problem = model_path_problem(value, layout_for(kind, args, value), pipeline=kind in ("pipeline", "encoder"))
        if problem:
            also = f" (and {', '.join(named[1:])})" if len(named) > 1 else ""
            problems.append(f"{named[0]}{also} {value}: {problem}")
    return problems


def model_path_problem(value: str, layout: Layout, pipeline: bool = True) -> str | None:
    """What is wrong with one model path (None: it loads without the network); `pipeline`: a diffusers pipeline
    (a built-in model name is one too), else a transformers model, processor or tokenizer folder."""
    from miles.builtin.checkpoints import builtin_checkpoint_dir, is_complete
    from miles.builtin.names import BUILTIN_MODELS, is_builtin_model

    if is_builtin_model(value):
        folder = builtin_checkpoint_dir(value)
        if folder.exists() and not is_complete(folder):
            return (
                f"{folder} exists but is not a complete {value} checkpoint; remove it and retry "
                f"(or run `miles models build {value} --force`)"
            )
        return None  # built on first use
    path = Path(value).expanduser()
    if path.is_dir():
        problem = layout(path)
        return None if problem is None else f"the folder {problem}"
    if path.exists():
        return "is a file, not a checkpoint folder; give the folder that holds it"
    if looks_like_hub_id(value):
        if cached_snapshot(value, lambda snap: layout(snap) is None) is not None:
            return None
        cached = snapshots(value)
        if cached:
            return (
                f"the cached snapshot {cached[0]} {layout(cached[0])} (`huggingface-cli download {value}` "
                "completes it)"
            )
        return (
            f"neither a local folder nor in {describe_cache()}; download it first "
            f"(`huggingface-cli download {value}`), or give a local folder or a built-in model "
            f"({', '.join(BUILTIN_MODELS[:2])}, ...)"
        )
    if not pipeline:
        return "no such folder; give a local folder or a Hugging Face id (org/name) in the local cache"
    return (
        "no such folder; give a local diffusers pipeline folder, a Hugging Face id (org/name) in the local "
        f"cache, or a built-in model ({', '.join(BUILTIN_MODELS[:2])}, ...)"
    )
