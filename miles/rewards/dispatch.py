"""Reward dispatch: `batched_async_rm(args, samples)` scores a list of samples, one value per sample.

Who scores what:
  * `--custom-rm-path`: `async def custom_rm(args, samples, **kwargs) -> list[float | dict]` gets the whole
    list and replaces the built-in dispatch (batched only: route per sample inside it if needed; a plain
    `def` works too). Extra `kwargs` of `batched_async_rm` are passed through.
  * Otherwise each sample's rewards are `sample.metadata.get("rm_type")` (one type), else the job's
    (`miles.rewards.reward_components`: `--rm-type a,b` or `--reward-weights a=1,b=0.2`). Samples are
    grouped by type and every type scores its samples as one batch (all types concurrently), so a mixed
    microgroup still gets batched model calls. Types with a registered `RewardPool` (see `pool.py` and
    `set_reward_pools`) score on their Ray actors; `remote_rm` through its HTTP client (`service/client.py`);
    the rest in this process, in a worker thread so the event loop keeps running. Each type's scorer is
    built from the reward table's `build` (`miles.rewards.REWARD_TYPES`).
  * A type that scores an edit against its source (`needs` "source" in the table, `RewardType.sourced`) gets each
    sample's condition images too, `scorer(images, prompts, metadata, sources=[s.sources, ...])`; a sample without
    any is a `RewardError` naming it. The other scorers are called exactly as before, without `sources`.
  * A multi-reward job's sample gets `reward = sum_k w_k * score_k` and `reward_components = {k: score_k}`;
    an unknown type is a `ConfigError` naming it and the sample.

Rewards are floats for the built-ins; a custom reward may return dicts, which stay dicts in
`sample.reward` and are read at `--reward-key` later (`Sample.scalar_reward`).

`--group-rm`: the rollout calls `score_groups(args, groups)` once every sample of a prompt group is
generated, which runs the same dispatch once per whole group; without it, it calls
`score_samples(args, microgroup)` right after each microgroup is generated.

A failing reward raises `RewardError` naming the reward type and the sample (index and prompt): when
a batch fails, its samples are re-scored one by one to find the culprit.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
import numbers
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from miles.core.errors import ConfigError
from miles.rewards import REWARD_TYPES, is_multi_reward, reward_components
from miles.rewards.errors import RewardError, describe_sample, describe_samples

if TYPE_CHECKING:
    from miles.core.sample import Sample

Reward = float | dict[str, float]
# scorer(images, prompts, metadata) -> one float per item; a sourced type's takes `sources=` too (one list of
# condition images per item)
Scorer = Callable[..., Sequence[float]]

BUILTIN_RM_TYPES = tuple(name for name, t in REWARD_TYPES.items() if t.build is not None)
REMOTE_RM = "remote_rm"


def _arg(args: Any, name: str, default: Any = None) -> Any:
    value = getattr(args, name, default)
    return default if value is None else value


# ---- settings and scorers ----------------------------------------------------------------------
@dataclass(frozen=True)
class RewardSettings:
    """The (picklable, hashable) part of args the built-in rewards read; what a reward worker gets."""

    hf_checkpoint: str | None = None
    pickscore_model_path: str | None = None
    pickscore_processor_path: str | None = None
    pickscore_batch_size: int = 8
    pickscore_num_frames: int | None = None
    # every other flag of the Reward group, (dest, value) sorted: what the other scorers read (`get`)
    options: tuple[tuple[str, Any], ...] = ()

    def get(self, dest: str, default: Any = None) -> Any:
        """A reward flag's value (`--clip-score-model-path` -> `get("clip_score_model_path")`)."""
        if dest in _FIELDS:
            return getattr(self, dest)
        value = dict(self.options).get(dest)
        return default if value is None else value

    @classmethod
    def from_args(cls, args: Any) -> RewardSettings:
        def text(name: str) -> str | None:
            value = _arg(args, name)
            return None if value is None else str(value)

        frames = _arg(args, "pickscore_num_frames")
        if frames is not None and int(frames) < 1:  # the CLI refuses it at parse time; args built in code too
            raise ConfigError(f"--pickscore-num-frames must be at least 1 (unset scores every frame), got {frames}")
        return cls(
            hf_checkpoint=_checkpoint_dir(args),
            pickscore_model_path=text("pickscore_model_path"),
            pickscore_processor_path=text("pickscore_processor_path"),
            pickscore_batch_size=int(_arg(args, "pickscore_batch_size", 8)),
            pickscore_num_frames=None if frames is None else int(frames),
            options=_reward_options(args),
        )


_FIELDS = (
    "hf_checkpoint",
    "pickscore_model_path",
    "pickscore_processor_path",
    "pickscore_batch_size",
    "pickscore_num_frames",
)


def _hashable(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((str(k), _hashable(v)) for k, v in value.items()))
    return value


def _reward_options(args: Any) -> tuple[tuple[str, Any], ...]:
    """The Reward group's flags other than the settings' own fields, as set on `args`."""
    from miles.config.catalog.reward import FLAGS

    out = []
    for flag in FLAGS:
        if flag.dest in _FIELDS:
            continue
        value = getattr(args, flag.dest, None)
        if value is not None:
            out.append((flag.dest, _hashable(value)))
    return tuple(sorted(out))


def _checkpoint_dir(args: Any) -> str | None:
    """The local folder of `--hf-checkpoint` (a built-in name resolved through `args.inputs`)."""
    from miles.core.inputs import input_path

    path = input_path(args, _arg(args, "hf_checkpoint"))
    return None if path is None else str(path)


def check_settings(settings: RewardSettings, rm_type: str) -> None:
    """Fail early (ConfigError) on a reward type the settings cannot serve."""
    if rm_type not in BUILTIN_RM_TYPES:
        raise ConfigError(f"unknown reward type {rm_type!r}; built-in types: {', '.join(BUILTIN_RM_TYPES)}")
    missing = ["--" + d.replace("_", "-") for d in REWARD_TYPES[rm_type].required if settings.get(d) is None]
    if missing:
        raise ConfigError(f"--rm-type {rm_type} requires {' and '.join(missing)}")


def check_reward_inputs(rm_type: str, prompt: str, metadata: Mapping[str, Any]) -> None:
    """What a built-in reward needs of a prompt line, checked without scoring (the preflight reads every line
    with it): ValueError, as the reward itself would raise it. The digit rewards need `metadata.label` (`digit_i2v`
    `metadata.direction` too), OCR a quoted target in the prompt. A sourced type's condition images (`source`) are
    not checked here: the row's media are the data reader's."""
    needs = REWARD_TYPES[rm_type].needs if rm_type in REWARD_TYPES else ()
    for need in needs:
        if need == "label":
            from miles.rewards.scorers.digit import digit_label

            digit_label(metadata)
        elif need == "quoted":
            from miles.rewards.scorers.ocr import extract_target

            extract_target(prompt)
        elif need == "direction":
            from miles.rewards.scorers.digit_i2v import digit_direction

            digit_direction(metadata)


def build_scorer(settings: RewardSettings, rm_type: str) -> Scorer:
    """The in-process scorer of a built-in reward type (models load once per process, cached)."""
    check_settings(settings, rm_type)
    from miles.utils.dotted import import_dotted

    build = REWARD_TYPES[rm_type].build
    assert build is not None, rm_type
    return import_dotted(build)(settings)


def _as_reward_value(value: Any, rm_type: str, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:  # numpy / torch scalar
            value = value.item()
        else:
            raise RewardError(f"reward {rm_type!r} returned {type(value).__name__} for {name}, expected a number")
    value = float(value)
    if not math.isfinite(value):
        raise RewardError(f"reward {rm_type!r} returned a non-finite value ({value}) for {name}")
    return value


def score_items(
    rm_type: str,
    scorer: Scorer,
    images: Sequence[Any],
    prompts: Sequence[str],
    metadata: Sequence[Mapping[str, Any]],
    names: Sequence[str],
    sources: Sequence[Sequence[Any]] | None = None,
) -> list[float]:
    """Run `scorer` on a batch; on failure, find the failing item and raise `RewardError` naming it. `sources` (a
    sourced type's: each item's condition images) is passed as `sources=` when given, else not at all."""

    def call(idx: Sequence[int] | None) -> Any:
        if idx is None:
            extra = {} if sources is None else {"sources": sources}
            return scorer(images, prompts, metadata, **extra)
        extra = {} if sources is None else {"sources": [sources[i] for i in idx]}
        return scorer([images[i] for i in idx], [prompts[i] for i in idx], [metadata[i] for i in idx], **extra)

    try:
        values = list(call(None))
    except Exception as exc:
        if len(images) > 1:
            for i in range(len(images)):
                try:
                    call([i])
                except Exception as item_exc:
                    raise RewardError(
                        f"reward {rm_type!r} failed on {names[i]}: {type(item_exc).__name__}: {item_exc}"
                    ) from item_exc
        raise RewardError(
            f"reward {rm_type!r} failed on {describe_samples(names)}: {type(exc).__name__}: {exc}"
        ) from exc
    if len(values) != len(images):
        raise RewardError(
            f"reward {rm_type!r} returned {len(values)} values for {len(images)} samples ({describe_samples(names)})"
        )
    return [_as_reward_value(v, rm_type, n) for v, n in zip(values, names, strict=True)]


@functools.lru_cache(maxsize=16)
def _cached_scorer(settings: RewardSettings, rm_type: str) -> Scorer:
    return build_scorer(settings, rm_type)


_SCORER_LOCK = threading.Lock()


def _get_scorer(settings: RewardSettings, rm_type: str) -> Scorer:
    with _SCORER_LOCK:  # concurrent first calls load the model once
        return _cached_scorer(settings, rm_type)


# ---- pools registry ----------------------------------------------------------------------------
_ACTIVE_POOLS: dict[str, Any] = {}


def set_reward_pools(pools: Mapping[str, Any] | None) -> None:
    """Register the `RewardPool`s (rm_type -> pool) the dispatch uses; None or {} clears them."""
    _ACTIVE_POOLS.clear()
    _ACTIVE_POOLS.update(pools or {})


def get_reward_pools() -> dict[str, Any]:
    return dict(_ACTIVE_POOLS)


# ---- dispatch ----------------------------------------------------------------------------------
def sample_components(args: Any, sample: Sample) -> tuple[tuple[str, float], ...]:
    """The rewards of one sample, ((type, weight), ...): `metadata.rm_type` (one type, weight 1) or the job's."""
    override = (sample.metadata or {}).get("rm_type")
    components = ((str(override), 1.0),) if override else reward_components(args)
    name = describe_sample(sample.index, sample.prompt)
    if not components:
        raise ConfigError(f"no reward type for {name}: set --rm-type, metadata.rm_type or --custom-rm-path")
    for rm_type, _ in components:
        if rm_type not in REWARD_TYPES:
            raise ConfigError(
                f"unknown reward type {rm_type!r} for {name}; reward types: {', '.join(REWARD_TYPES)} "
                "(or use --custom-rm-path)"
            )
    return components


def resolve_rm_type(args: Any, sample: Sample) -> str:
    """The one reward type of a sample (ConfigError if the job combines several)."""
    components = sample_components(args, sample)
    if len(components) != 1:
        raise ConfigError(f"{describe_sample(sample.index, sample.prompt)} is scored by several reward types")
    return components[0][0]


@functools.lru_cache(maxsize=8)
def load_custom_rm(path: str) -> Callable[..., Any]:
    from miles.utils.dotted import import_dotted

    try:
        fn = import_dotted(path)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"--custom-rm-path {path}: cannot import it ({exc})") from exc
    if not callable(fn):
        raise ConfigError(f"--custom-rm-path {path} is not a function")
    from miles.utils.deadline import timed

    return timed(fn, f"--custom-rm-path {path}")


def _as_custom_reward(value: Any, path: str, name: str) -> Reward:
    if isinstance(value, Mapping):
        return {str(k): _as_reward_value(v, f"custom {path}", f"{name}[{k!r}]") for k, v in value.items()}
    return _as_reward_value(value, f"custom {path}", name)


async def custom_rewards(args: Any, samples: list[Sample], path: str, **kwargs: Any) -> list[Reward]:
    """The rewards the `--custom-rm-path` function at `path` gives `samples` (a failure is a RewardError)."""
    fn = load_custom_rm(path)
    names = [describe_sample(s.index, s.prompt) for s in samples]
    try:
        result = fn(args, samples, **kwargs)
        if inspect.isawaitable(result):
            result = await result
    except (RewardError, ConfigError):
        raise
    except Exception as exc:
        raise RewardError(
            f"custom reward {path} failed on {describe_samples(names)}: {type(exc).__name__}: {exc}"
        ) from exc
    try:
        values = list(result)
    except TypeError:
        raise RewardError(f"custom reward {path} returned {type(result).__name__}, expected a list") from None
    if len(values) != len(samples):
        raise RewardError(f"custom reward {path} returned {len(values)} rewards for {len(samples)} samples")
    return [_as_custom_reward(v, path, n) for v, n in zip(values, names, strict=True)]


def _check_image(sample: Sample, rm_type: str) -> Any:
    if sample.image is None:
        raise RewardError(f"reward {rm_type!r}: {describe_sample(sample.index, sample.prompt)} has no image")
    return sample.image


def check_sources(sample: Sample, rm_type: str) -> list[Any]:
    """A sourced type's input of one sample: its condition images (RewardError in one line when it has none)."""
    if not sample.sources:
        raise RewardError(
            f"reward {rm_type!r}: {describe_sample(sample.index, sample.prompt)} has no source image; {rm_type} "
            "scores an edit against its source (give the prompt rows media)"
        )
    return list(sample.sources)


def sources_of(samples: Sequence[Sample], rm_type: str) -> list[list[Any]] | None:
    """Each sample's condition images when `rm_type` scores an edit against its source (the reward table's
    `needs`), else None: the scorer is then called without them."""
    entry = REWARD_TYPES.get(rm_type)
    if entry is None or not entry.sourced:
        return None
    return [check_sources(s, rm_type) for s in samples]


async def _score_type(
    args: Any, rm_type: str, samples: list[Sample], pools: Mapping[str, Any], settings: RewardSettings
) -> list[float]:
    pool = pools.get(rm_type)
    if pool is not None:
        return list(await pool.score(samples))
    images = [_check_image(s, rm_type) for s in samples]
    sources = sources_of(samples, rm_type)
    prompts = [s.prompt for s in samples]
    metadata = [dict(s.metadata or {}) for s in samples]
    names = [describe_sample(s.index, s.prompt) for s in samples]
    if rm_type == REMOTE_RM:
        from miles.rewards.scorers.remote import client_for

        client = await client_for(args)
        values = await client.score(images, prompts, metadata, names)
        return [_as_reward_value(v, rm_type, n) for v, n in zip(values, names, strict=True)]
    check_settings(settings, rm_type)

    def run() -> list[float]:  # in a worker thread: loading a model must not block the event loop either
        try:
            scorer = _get_scorer(settings, rm_type)
        except ConfigError:
            raise
        except Exception as exc:
            raise RewardError(f"reward {rm_type!r} could not load: {type(exc).__name__}: {exc}") from exc
        return score_items(rm_type, scorer, images, prompts, metadata, names, sources)

    return await asyncio.to_thread(run)


async def _score_components(
    args: Any, samples: list[Sample], pools: Mapping[str, Any] | None
) -> tuple[list[float], list[dict[str, float]]]:
    """Every sample's reward (the weighted sum of its components) and its components, each type scored once."""
    components = [sample_components(args, s) for s in samples]
    by_type: dict[str, list[int]] = {}
    for i, comps in enumerate(components):
        for rm_type, _ in comps:
            by_type.setdefault(rm_type, []).append(i)
    settings = RewardSettings.from_args(args)
    active = _ACTIVE_POOLS if pools is None else pools
    results = await asyncio.gather(
        *(_score_type(args, t, [samples[i] for i in idx], active, settings) for t, idx in by_type.items())
    )
    raw: list[dict[str, float]] = [{} for _ in samples]
    for rm_type, idx, values in zip(by_type, by_type.values(), results, strict=True):
        for i, value in zip(idx, values, strict=True):
            raw[i][rm_type] = value
    rewards = [combine(raw[i], comps) for i, comps in enumerate(components)]
    return rewards, raw


def combine(raw: Mapping[str, float], components: Sequence[tuple[str, float]]) -> float:
    """sum_k w_k * raw_k, in the components' order (a single weight-1 component is its raw value, exactly)."""
    if len(components) == 1 and components[0][1] == 1.0:
        return float(raw[components[0][0]])
    return float(math.fsum(weight * raw[name] for name, weight in components))


async def batched_async_rm(
    args: Any, samples: Sequence[Sample], *, pools: Mapping[str, Any] | None = None, **kwargs: Any
) -> list[Reward]:
    """One reward per sample, in order (see the module docstring). `pools` overrides the registered pools."""
    samples = list(samples)
    if not samples:
        return []
    custom = _arg(args, "custom_rm_path")
    if custom is not None:
        return await custom_rewards(args, samples, str(custom), **kwargs)
    rewards, _ = await _score_components(args, samples, pools)
    return list(rewards)


async def score_samples(args: Any, samples: Sequence[Sample], **kwargs: Any) -> list[Reward]:
    """`batched_async_rm`, then store each reward in `sample.reward` (and, in a multi-reward job, its components in
    `sample.reward_components`)."""
    samples = list(samples)
    custom = _arg(args, "custom_rm_path")
    if custom is not None or not samples:
        rewards = await batched_async_rm(args, samples, **kwargs)
        components: list[dict[str, float] | None] = [None] * len(samples)
    else:
        rewards, raw = await _score_components(args, samples, kwargs.get("pools"))
        multi = is_multi_reward(args)
        components = [dict(r) if multi or len(r) > 1 else None for r in raw]
    for sample, reward, comps in zip(samples, rewards, components, strict=True):
        sample.reward = reward
        sample.reward_components = comps
    return list(rewards)


async def score_groups(args: Any, groups: Sequence[Sequence[Sample]], **kwargs: Any) -> list[list[Reward]]:
    """`--group-rm`: one dispatch call per whole prompt group (groups concurrently); sets `sample.reward`."""
    return list(await asyncio.gather(*(score_samples(args, group, **kwargs) for group in groups)))
