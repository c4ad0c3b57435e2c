"""The rollout manager's and the loops' user hooks (dotted import paths, loaded once per process).

--rollout-function-path  (train rl, rollout-only)
    generate_rollout(args, rollout_id, data_source, evaluation=False) -> RolloutFnTrainOutput | groups
    Replaces the sampling of one rollout (drawing the prompt groups and generating them). Return the
    groups as `list[list[Sample]]` (one list per prompt, `n_samples_per_prompt` samples), a flat
    `list[Sample]` (grouped by `group_index`), or `RolloutFnTrainOutput(samples, metrics)` (either form;
    `metrics` are added to the rollout's). miles then scores every sample whose `reward` is None, runs the
    dynamic and sample filters and computes the advantages, as for its own rollout. A sample that is to be
    trained on needs its `trajectory` and `conditions`. The built-in rollout is named by
    `miles.rollout.sglang_rollout.generate_rollout` (the reference default),
    `miles.rollout.sglang_diffusion_rollout.generate_rollout` (the diffusion recipes) or
    `miles.rollout.manager.RolloutManager.generate`; any of them means "no hook".

--eval-function-path  (default: --rollout-function-path when that names a user function)
    Same shape, called with `evaluation=True` (and the data source, or None when the job has no
    --prompt-data). Return `RolloutFnEvalOutput(data, metrics)` or a dict `{dataset name: list[Sample]}`;
    miles scores samples without a reward and adds `eval/<name>/...` metrics (yours win on a clash).
    `rollout_id` is the rollout the eval runs before (0 in `miles eval`).

--custom-generate-function-path  (every engine-backed job; replaces the engine call per microgroup)
    async def custom_generate(args, microgroup: list[Sample], sampling_params: dict, *, evaluation=False)
        -> list[Sample]
    `microgroup` holds the planned samples of one request (prompt, metadata, index, group_index, seed);
    `sampling_params` the request's knobs (num_steps, guidance_scale, noise_level, sde_type, sde_steps
    per sample, height, width, negative_prompt, ...). Return one completed sample per planned one, in
    order (index, group_index and metadata are taken from the plan). `evaluation=` is passed only when
    the signature takes it; a plain (non-async) function works too. All microgroups run concurrently.

--custom-rollout-log-function-path  (train rl, rollout-only)
    log_rollout_data(rollout_id, args, samples, rollout_extra_metrics, rollout_time) -> bool
--custom-eval-rollout-log-function-path  (train rl, eval)
    log_eval_rollout_data(rollout_id, args, data, extra_metrics) -> bool   # data: {name: list[Sample]}
    Called before the default logging of that rollout / eval; a truthy return skips the default logging
    (metrics.jsonl line, wandb/tensorboard, image grids), a falsy one layers on top of it.

A hook that returns something miles cannot use raises `RolloutHookError`, one line naming the flag.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from miles.config.backends import is_builtin_rollout
from miles.utils.hooks import load_function

ROLLOUT_FLAG = "--rollout-function-path"
EVAL_FLAG = "--eval-function-path"
GENERATE_FLAG = "--custom-generate-function-path"
LOG_FLAG = "--custom-rollout-log-function-path"
EVAL_LOG_FLAG = "--custom-eval-rollout-log-function-path"

# GenerateRequest fields that travel in the microgroup's samples, not in sampling_params
_PER_SAMPLE = ("prompt", "metadata", "group_index", "indices", "seeds")


class RolloutHookError(ValueError):
    """A rollout hook returned something miles cannot use."""


@dataclass
class RolloutFnTrainOutput:
    samples: list[Any]  # list[list[Sample]] or list[Sample]
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class RolloutFnEvalOutput:
    data: dict[str, list[Any]]  # dataset name -> list[Sample]
    metrics: dict[str, float] = field(default_factory=dict)


def _load(args: Any, dest: str, flag: str) -> Callable[..., Any] | None:
    path = getattr(args, dest, None)
    return load_function(path, flag) if path else None


def rollout_function(args: Any) -> Callable[..., Any] | None:
    """The user's `--rollout-function-path`, or None for the built-in rollout."""
    path = args.rollout_function_path
    return None if is_builtin_rollout(path) else load_function(path, ROLLOUT_FLAG)


def eval_function(args: Any) -> tuple[Callable[..., Any], str, str] | None:
    """(fn, flag, path) of the eval rollout: `--eval-function-path`, else a user `--rollout-function-path`."""
    for dest, flag in (("eval_function_path", EVAL_FLAG), ("rollout_function_path", ROLLOUT_FLAG)):
        path = getattr(args, dest, None)
        if path:
            return None if is_builtin_rollout(path) else (load_function(path, flag), flag, path)
    return None


def _fail(flag: str, path: Any, what: str) -> RolloutHookError:
    return RolloutHookError(f"{flag} {path!r} {what}")


def _is_samples(value: Any) -> bool:
    from miles.core.sample import Sample

    return isinstance(value, list) and all(isinstance(s, Sample) for s in value)


def call_train_rollout(args: Any, rollout_id: int, data_source: Any) -> tuple[list[list[Any]], dict[str, float]]:
    """Run the user rollout function: (groups, extra metrics)."""
    fn = rollout_function(args)
    assert fn is not None
    path = args.rollout_function_path
    out = fn(args, rollout_id, data_source, evaluation=False)
    metrics: dict[str, float] = {}
    if isinstance(out, RolloutFnTrainOutput) or (hasattr(out, "samples") and not isinstance(out, list)):
        metrics = dict(getattr(out, "metrics", None) or {})
        out = out.samples
    if _is_samples(out) and out:  # flat: group by group_index, in order of first appearance
        by_group: dict[int, list[Any]] = {}
        for sample in out:
            by_group.setdefault(sample.group_index, []).append(sample)
        out = list(by_group.values())
    if not isinstance(out, list) or not out or not all(_is_samples(g) and g for g in out):
        raise _fail(
            ROLLOUT_FLAG,
            path,
            f"returned {_kind(out)}; expected a non-empty list[list[Sample]], list[Sample] or RolloutFnTrainOutput",
        )
    return out, metrics


def call_eval_rollout(args: Any, rollout_id: int, data_source: Any) -> tuple[dict[str, list[Any]], dict[str, float]]:
    """Run the user eval function: ({dataset name: samples}, extra metrics)."""
    found = eval_function(args)
    assert found is not None
    fn, flag, path = found
    out = fn(args, rollout_id, data_source, evaluation=True)
    metrics: dict[str, float] = {}
    if isinstance(out, RolloutFnEvalOutput) or hasattr(out, "data"):
        metrics = dict(getattr(out, "metrics", None) or {})
        out = out.data
    if not isinstance(out, dict) or not all(isinstance(k, str) and _is_samples(v) and v for k, v in out.items()):
        raise _fail(flag, path, f"returned {_kind(out)}; expected RolloutFnEvalOutput or dict[str, list[Sample]]")
    return out, metrics


# ---- --custom-generate-function-path --------------------------------------------------------------
def generate_function(args: Any) -> Callable[..., Any] | None:
    return _load(args, "custom_generate_function_path", GENERATE_FLAG)


def _takes_evaluation(fn: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "evaluation" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def planned_samples(request: Any) -> list[Any]:
    from miles.core.sample import PENDING

    planned = [request.sample(b) for b in range(len(request.seeds))]
    for sample in planned:
        sample.status = PENDING
    return planned


def sampling_params(request: Any) -> dict[str, Any]:
    return {k: v for k, v in dataclasses.asdict(request).items() if k not in _PER_SAMPLE}


def run_custom_generate(args: Any, requests: list[Any]) -> list[Any]:
    """Every request through the user's generate function (concurrently); the completed samples."""
    fn = generate_function(args)
    assert fn is not None
    path = args.custom_generate_function_path
    evaluation_kw = _takes_evaluation(fn)

    async def one(request: Any) -> list[Any]:
        planned = planned_samples(request)
        kwargs = {"evaluation": bool(request.evaluation)} if evaluation_kw else {}
        out = fn(args, planned, sampling_params(request), **kwargs)
        if inspect.isawaitable(out):
            out = await out
        if not _is_samples(out) or len(out) != len(planned):
            raise _fail(
                GENERATE_FLAG,
                path,
                f"returned {_kind(out)}; expected a list of {len(planned)} Sample (one per planned)",
            )
        for plan, done in zip(planned, out, strict=True):
            done.index, done.group_index, done.metadata = plan.index, plan.group_index, plan.metadata
        return out

    async def every() -> list[list[Any]]:
        return await asyncio.gather(*(one(r) for r in requests))

    return [s for result in asyncio.run(every()) for s in result]


# ---- log hooks ------------------------------------------------------------------------------------
def log_rollout(args: Any, rollout_id: int, samples: list[Any], metrics: dict[str, float]) -> bool:
    """Call `--custom-rollout-log-function-path`; True when the default logging is to be skipped."""
    fn = _load(args, "custom_rollout_log_function_path", LOG_FLAG)
    if fn is None:
        return False
    return bool(fn(rollout_id, args, samples, dict(metrics), float(metrics.get("perf/rollout_time", 0.0))))


def log_eval(args: Any, rollout_id: int, data: dict[str, list[Any]], metrics: dict[str, float]) -> bool:
    """Call `--custom-eval-rollout-log-function-path`; True when the default logging is to be skipped."""
    fn = _load(args, "custom_eval_rollout_log_function_path", EVAL_LOG_FLAG)
    if fn is None:
        return False
    return bool(fn(rollout_id, args, data, dict(metrics)))


def _kind(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60] + '...' if len(text) > 60 else text}"
