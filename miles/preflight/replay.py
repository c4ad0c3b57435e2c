"""Rollout files a job trains on: `miles replay ROLLOUT.pt`, or `train rl --load-debug-rollout-data TEMPLATE`.

Each file the run will read must exist; the first is loaded (`miles.io.rollout_file.load_rollout`, so this check
imports torch, and only for these jobs): it must hold samples (an empty rollout trains nothing) in whole prompt
groups (a multiple of --n-samples-per-prompt), survive `--load-debug-rollout-data-subsample`, every sample the
trainer keeps must have a trajectory and a finite reward and advantage, and the file must have been made with the
job's model: a file that records its model (`extra["model"]`) is refused when the family or a denoiser shape
differs from the job's `--hf-checkpoint`. An older file without the record has its first sample's latents
compared with what the checkpoint makes, where the family's latent layout is the plain one (channels =
the transformer's `in_channels`, size = --diffusion-height/width over the VAE's scale factor).
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles.core.errors import ConfigError
from miles.utils.text import clip, clip_repr

if TYPE_CHECKING:
    from miles.config.resolve import ResolvedJob

REPLAY_LABEL = "ROLLOUT.pt"
TEMPLATE_FLAG = "--load-debug-rollout-data"


def _rollout_ids(args: Any) -> range:
    """The rollout ids `train rl` reads from the template: from the resumed (or --start-rollout-id) one on."""
    end = int(args.num_rollout or 1)
    if args.start_rollout_id is not None:
        return range(int(args.start_rollout_id), end)
    if args.load is None:
        return range(0, end)
    from miles.training.checkpoint_index import find_loadable_checkpoint

    try:
        folder = find_loadable_checkpoint(args.load, args.ckpt_step).path
        start = int(json.loads((folder / "extra.json").read_text(encoding="utf-8"))["rollout_id"]) + 1
    except (ConfigError, OSError, ValueError, KeyError, TypeError):
        start = end - 1  # the --load check names the problem; look at the last file only
    return range(max(0, start), end)


def _format(template: str, rollout_id: int) -> Path:
    from miles.io.rollout_file import format_rollout_path

    return format_rollout_path(template, rollout_id)


def check_rollout_files(resolved: ResolvedJob) -> list[str]:
    args = resolved.trainer_args.get("actor", resolved.args)
    template = args.load_debug_rollout_data
    if template is None:
        return []
    if resolved.spec.takes_rollout_file:  # `miles replay ROLLOUT.pt`: that one file
        label, paths = REPLAY_LABEL, [Path(str(template)).expanduser()]
    else:
        label = TEMPLATE_FLAG
        ids = _rollout_ids(args)
        paths = [_format(str(template), rid) for rid in ids]
        missing = [(rid, p) for rid, p in zip(ids, paths, strict=True) if not p.is_file()]
        if missing:
            shown = ", ".join(str(rid) for rid, _ in missing[:8]) + (", ..." if len(missing) > 8 else "")
            return [
                f"{label} {template}: {len(missing)} of the {len(paths)} rollout files the run reads are missing "
                f"(rollout ids {shown}; first: {clip(str(missing[0][1]), 160)}); save them with "
                "`--save-debug-rollout-data` (or `miles rollout-only`), or lower --num-rollout"
            ]
    if not paths:
        return []
    return [f"{label} {problem}" for problem in rollout_file_problems(paths[0], args)]


def rollout_file_problems(path: Path, args: Any) -> list[str]:
    """What is wrong with one rollout file for this job, one line each ([]: it can be trained on)."""
    from miles.io.rollout_file import load_rollout, rollout_model, subsample_rollout

    try:
        rollout_id, samples, extra = load_rollout(path)
    except ConfigError as exc:
        return [str(exc)]
    if not samples:
        return [
            f"{path}: rollout {clip_repr(rollout_id)} holds no samples, so there is nothing to train on; "
            "replay a rollout that has samples"
        ]
    problems = [f"{path}: {problem}" for problem in sample_problems(samples)]
    group = int(args.n_samples_per_prompt or 1)
    if len(samples) % group:
        problems.append(
            f"{path}: {len(samples)} samples, not a multiple of --n-samples-per-prompt {group} (a rollout holds "
            "whole prompt groups); replay a whole rollout, or give the --n-samples-per-prompt it was made with"
        )
    elif args.load_debug_rollout_data_subsample:
        try:
            subsample_rollout(samples, args.load_debug_rollout_data_subsample, group_size=group)
        except (ConfigError, ValueError) as exc:
            problems.append(f"{path}: {exc}")
    made_with = rollout_model(extra)
    problem = model_problem(made_with, args) if made_with is not None else latent_problem(samples, args)
    if problem:
        problems.append(f"{path}: {problem}")
    return problems


# ---- the samples ------------------------------------------------------------------------------------------------
def sample_problems(samples: list[Any]) -> list[str]:
    """One phrase per kind of damage among the samples the trainer keeps (not `remove_sample`), naming the first
    such sample: no trajectory, a reward or an advantage that is not a finite number."""
    problems = []
    for check, remedy in _SAMPLE_CHECKS:
        found = [(i, why) for i, sample in enumerate(samples) if not sample.remove_sample and (why := check(sample))]
        if found:
            index, why = found[0]
            rest = len(found) - 1
            more = f" (and {rest} more sample{'s' if rest > 1 else ''})" if rest else ""
            problems.append(f"samples[{index}] {why}{more}; {remedy}")
    return problems


def _no_trajectory(sample: Any) -> str | None:
    if sample.trajectory is None:
        return "has no trajectory (the latents it was denoised through), so it cannot be trained on"
    return None


def _number_problem(value: Any, what: str) -> str | None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return f"has {what} {clip_repr(value)}, not a number"
    if not math.isfinite(float(value)):
        return f"has a non-finite {what} ({float(value)})"
    return None


def _bad_reward(sample: Any) -> str | None:
    reward = sample.reward
    if reward is None:
        return None  # the advantage is what trains; a missing one is named there
    if isinstance(reward, dict):
        for key, value in sorted(reward.items(), key=lambda item: str(item[0])):
            problem = _number_problem(value, f"reward[{key!r}]")
            if problem:
                return problem
        return None
    return _number_problem(reward, "reward")


def _bad_advantage(sample: Any) -> str | None:
    if sample.advantage is None:
        return "has no advantage"
    return _number_problem(sample.advantage, "advantage")


_SAMPLE_CHECKS: tuple[tuple[Callable[[Any], str | None], str], ...] = (
    (_no_trajectory, "replay a rollout saved with its trajectories (`miles rollout-only`, --save-debug-rollout-data)"),
    (_bad_reward, "replay a rollout whose rewards are finite numbers, or mark those samples remove_sample"),
    (_bad_advantage, "replay a rollout whose advantages were computed from finite rewards"),
)


# ---- the model it was made with ---------------------------------------------------------------------------------
def model_problem(made_with: dict[str, Any], args: Any) -> str | None:
    """The file's model record against the job's checkpoint (None: they agree, or the job's cannot be told)."""
    from miles.models.model_record import describe_record, model_record_of, record_differences

    current = model_record_of(args)
    if current is None:
        return None  # a model the record cannot describe: nothing to compare
    differences = record_differences(made_with, current)
    if not differences:
        return None
    return (
        f"made with {clip(describe_record(made_with), 200)}, but the job's --hf-checkpoint is "
        f"{clip(describe_record(current), 200)} ({'; '.join(differences)}); replay it on the checkpoint it was "
        "made with, or make a new rollout with this one (`miles rollout-only`)"
    )


def latent_problem(samples: list[Any], args: Any) -> str | None:
    """A file without a model record: the latent `(C, h, w)` of its first sample with a trajectory against what
    the job's checkpoint makes (None: they agree, or the checkpoint's layout or configs cannot tell)."""
    index, shape = next(
        ((i, tuple(getattr(s.trajectory.latents, "shape", ()))) for i, s in enumerate(samples) if s.trajectory),
        (0, ()),
    )
    if len(shape) != 4:
        return None  # [T+1, C, h, w] is the plain layout; a video or packed one is not compared
    expected = expected_latent(args)
    if expected is None:
        return None
    have, (channels, size) = shape[1:], expected
    want = (channels, *size) if size is not None else None
    if have[0] == channels and (want is None or have == want):
        return None
    checkpoint = args.hf_checkpoint
    if want is None:
        return (
            f"samples[{index}]'s latents have {have[0]} channels, but the job's --hf-checkpoint {checkpoint} takes "
            f"{channels} (the transformer's in_channels); the file records no model: replay it on the checkpoint it "
            "was made with"
        )
    return (
        f"samples[{index}]'s latents are {'x'.join(map(str, have))} (channels x height x width), but the job's "
        f"--hf-checkpoint {checkpoint} (transformer in_channels {channels}) at --diffusion-height "
        f"{args.diffusion_height} --diffusion-width {args.diffusion_width} makes {'x'.join(map(str, want))}; the "
        "file records no model: replay it with the checkpoint and size it was made with"
    )


def expected_latent(args: Any) -> tuple[int, tuple[int, int] | None] | None:
    """(channels, (h, w) or None) of one latent the job's checkpoint makes, for a family with the plain latent
    layout (channels = the transformer's in_channels; h, w = the size over 2 ** (VAE blocks - 1)), read from the
    checkpoint's configs; None where that cannot be told (another layout, a hub id not in the cache, ...)."""
    from miles.models.families import resolve_family
    from miles.models.model_record import local_checkpoint_dir, read_json_object
    from miles.models.pipeline_config import TrainPipelineConfig

    checkpoint = args.hf_checkpoint
    if checkpoint is None or args.train_pipeline_config_path:
        return None
    try:
        family = resolve_family(checkpoint, family=args.diffusion_model_family, require_trainable=False)
    except ConfigError:
        return None
    cls = type(family)
    plain = cls.latent_channels is TrainPipelineConfig.latent_channels
    if not plain or cls.latent_shape is not TrainPipelineConfig.latent_shape or family.experts:
        return None
    folder = local_checkpoint_dir(checkpoint)
    transformer = read_json_object(folder / family.transformer_subfolder / "config.json") if folder else None
    channels = (transformer or {}).get("in_channels")
    if isinstance(channels, bool) or not isinstance(channels, int):
        return None
    return channels, _latent_size(folder, args)


def _latent_size(folder: Path | None, args: Any) -> tuple[int, int] | None:
    from miles.models.model_record import read_json_object

    vae = read_json_object(folder / "vae" / "config.json") if folder else None
    blocks = (vae or {}).get("block_out_channels")
    if not isinstance(blocks, list) or not blocks:
        return None
    factor = 2 ** (len(blocks) - 1)
    height, width = int(args.diffusion_height), int(args.diffusion_width)
    if height % factor or width % factor:
        return None  # the config rules name a size the VAE cannot make
    return height // factor, width // factor
