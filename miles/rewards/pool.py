"""Reward actor pools on Ray: each worker loads its reward model once; batches go round-robin.

    pool = RewardPool(args, "ocr")              # --ocr-num-workers CPU actors
    rewards = await pool.score(samples)         # list[float], in order
    pools = make_reward_pools(args)             # pools for the rm types in use, registered for dispatch
    rewards = await batched_async_rm(args, samples)   # now scores ocr / pickscore on the pools

Only what the reward needs travels to a worker: (image as a float32 numpy array, prompt, metadata)
per sample, plus a one-line name for error messages, never the trajectory; a type that scores an edit against its
source (`RewardType.sourced`) gets each sample's condition images too, as float32 arrays. Chunks: `ocr` (and the
other CPU rewards) split a call evenly over the workers; `pickscore` sends `--pickscore-batch-size`
images per call. Each call takes the next worker in turn.

Placement: one CPU per worker. `pickscore` workers on a GPU cluster sit in the reward slots of the job's
placement plan (`--pickscore-num-gpus-per-worker` GPUs each, fractions packed; on the rollout GPUs under
`--colocate-reward`); with no GPU they score on CPU.

Errors never hang: a reward that raises in a worker surfaces as `RewardError` naming the reward type
and the sample; a dead worker or a call slower than `timeout_s` is a `RewardError` naming the samples.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import os
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from miles.core.errors import ConfigError
from miles.rewards import REWARD_TYPES, reward_names
from miles.rewards.dispatch import (
    RewardError,
    RewardSettings,
    build_scorer,
    check_settings,
    describe_sample,
    describe_samples,
    get_reward_pools,
    score_items,
    set_reward_pools,
    sources_of,
)
from miles.utils.actors import owned_remote, tag_for

if TYPE_CHECKING:
    from miles.core.sample import Sample

POOLED_RM_TYPES = tuple(name for name, t in REWARD_TYPES.items() if t.pooled)  # model-backed: pools by default
DEFAULT_TIMEOUT_S = 600.0
DEFAULT_START_TIMEOUT_S = 300.0


class RewardWorker:
    """The body of one reward actor: a scorer built once, scoring batches of plain items."""

    def __init__(self, settings: RewardSettings, rm_type: str, num_cpus: int = 1) -> None:
        os.environ.setdefault("MILES_OCR_NUM_THREADS", str(max(1, num_cpus)))
        self.rm_type = rm_type
        self.scorer = build_scorer(settings, rm_type)

    def ready(self) -> bool:
        return True

    def placement_info(self) -> dict[str, Any]:
        from miles.placement.ray_placement import actor_placement_info

        return actor_placement_info(str(getattr(self.scorer, "device", "cpu")))

    def score(
        self,
        images: list[Any],
        prompts: list[str],
        metadata: list[dict[str, Any]],
        names: list[str],
        sources: list[list[Any]] | None = None,
    ) -> list[float]:
        return score_items(self.rm_type, self.scorer, images, prompts, metadata, names, sources)


def _default_num_workers(args: Any, rm_type: str) -> int:
    flag = REWARD_TYPES[rm_type].workers_flag if rm_type in REWARD_TYPES else None
    value = getattr(args, flag, None) if flag else None
    return int(value) if value is not None else 1


def _cluster_has_gpus() -> bool:
    import ray

    return float(ray.cluster_resources().get("GPU", 0)) > 0


def _worker_options(
    placement: Any, rm_type: str, num_gpus: float, num_cpus: int, num_workers: int
) -> list[dict[str, Any]]:
    """Ray options per worker: the plan's reward slots for GPU workers (`placement`), else CPU workers (or,
    with no placement, GPU workers wherever Ray finds room)."""
    if placement is None:
        gpus = num_gpus if _cluster_has_gpus() else 0.0
        return [{"num_cpus": num_cpus, "num_gpus": gpus}] * num_workers
    if num_gpus <= 0:
        return [{"num_cpus": num_cpus, "num_gpus": 0}] * num_workers
    slots = placement.slots("reward")
    if not slots:
        if not placement.gpu_mode:
            return [{"num_cpus": num_cpus, "num_gpus": 0}] * num_workers
        raise ConfigError(
            f"{rm_type} reward workers need GPUs (--pickscore-num-gpus-per-worker {num_gpus:g}) and the placement "
            "plan gave them none: the prompt data asks for it through metadata.rm_type while --rm-type is not "
            f"{rm_type}; pass --rm-type {rm_type}, or --pickscore-num-gpus-per-worker 0 to score on CPU"
        )
    return [placement.options(slot) for slot in slots]


def _to_wire(image: Any) -> Any:
    """A tensor image -> a float32 numpy array (zero-copy through Ray's object store)."""
    if hasattr(image, "detach"):
        image = image.detach().cpu()
        return image.float().numpy() if image.is_floating_point() else image.numpy()
    return image


class RewardPool:
    """`num_workers` Ray actors serving one reward type; `await score(samples)` -> list[float]."""

    def __init__(
        self,
        args: Any,
        rm_type: str,
        num_workers: int | None = None,
        *,
        num_gpus_per_worker: float | None = None,
        num_cpus_per_worker: int = 1,
        timeout_s: float | None = None,
        start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
        placement: Any = None,
    ) -> None:
        import ray

        self.rm_type = rm_type
        self.settings = RewardSettings.from_args(args)
        check_settings(self.settings, rm_type)
        if not ray.is_initialized():
            raise RuntimeError("RewardPool needs a running Ray (call ray.init() first)")
        self.num_workers = int(num_workers if num_workers is not None else _default_num_workers(args, rm_type))
        if self.num_workers < 1:
            raise ConfigError(f"a {rm_type!r} reward pool needs at least one worker, got {self.num_workers}")
        if num_gpus_per_worker is None:
            gpu_flag = REWARD_TYPES[rm_type].gpu_flag
            num_gpus_per_worker = float(getattr(args, gpu_flag, None) or 0.0) if gpu_flag else 0.0
        options = _worker_options(placement, rm_type, num_gpus_per_worker, num_cpus_per_worker, self.num_workers)
        self.num_workers = len(options)
        self.num_gpus_per_worker = float(options[0].get("num_gpus", 0.0))
        if timeout_s is None:  # --hook-timeout (0: no limit), else the pool's own default
            flag = args.hook_timeout
            timeout_s = DEFAULT_TIMEOUT_S if flag is None else (float(flag) or None)
        self.timeout_s = None if timeout_s is None else float(timeout_s)
        actor_cls = owned_remote(RewardWorker)
        self.workers = [
            actor_cls.options(**option).remote(
                self.settings, rm_type, num_cpus_per_worker, _miles_tag=tag_for(args, f"reward_{rm_type}", i)
            )
            for i, option in enumerate(options)
        ]
        self._turn = itertools.count()
        try:
            ray.get([w.ready.remote() for w in self.workers], timeout=start_timeout_s)
        except Exception as exc:
            self.shutdown()
            raise RewardError(f"the {rm_type!r} reward workers failed to start: {_cause(exc)}") from exc

    # ---- submission ----------------------------------------------------------------------------
    def _chunk_size(self, n: int) -> int:
        if self.rm_type == "pickscore":
            return max(1, self.settings.pickscore_batch_size)
        return max(1, math.ceil(n / self.num_workers))

    def _submit(self, samples: Sequence[Sample]) -> list[tuple[int, list[str], Any]]:
        """Send the samples in chunks, round-robin; -> [(worker index, sample names, ObjectRef)]."""
        items = []
        for s in samples:
            name = describe_sample(s.index, s.prompt)
            if s.image is None:
                raise RewardError(f"reward {self.rm_type!r}: {name} has no image")
            items.append((_to_wire(s.image), s.prompt, dict(s.metadata or {}), name))
        sources = sources_of(samples, self.rm_type)
        wire_sources = None if sources is None else [[_to_wire(im) for im in per] for per in sources]
        size = self._chunk_size(len(items))
        calls = []
        for start in range(0, len(items), size):
            chunk = items[start : start + size]
            k = next(self._turn) % self.num_workers
            images, prompts, metadata, names = (list(col) for col in zip(*chunk, strict=True))
            extra = {} if wire_sources is None else {"sources": wire_sources[start : start + size]}
            calls.append((k, names, self.workers[k].score.remote(images, prompts, metadata, names, **extra)))
        return calls

    def _error(self, exc: BaseException, worker: int, names: list[str]) -> RewardError:
        import ray

        if isinstance(exc, ray.exceptions.RayTaskError):
            cause = exc.cause
            if isinstance(cause, RewardError):
                return RewardError(f"{cause} (reward worker {worker})")
            return RewardError(
                f"reward {self.rm_type!r} failed on {describe_samples(names)} in worker {worker}: {_cause(exc)}"
            )
        if isinstance(exc, (asyncio.TimeoutError, TimeoutError, ray.exceptions.GetTimeoutError)):
            return RewardError(
                f"reward {self.rm_type!r} timed out after {self.timeout_s:g} s on {describe_samples(names)} "
                f"(worker {worker})"
            )
        return RewardError(
            f"reward {self.rm_type!r} worker {worker} failed on {describe_samples(names)}: {type(exc).__name__}: {exc}"
        )

    # ---- scoring -------------------------------------------------------------------------------
    async def score(self, samples: Sequence[Sample]) -> list[float]:
        """One reward per sample, in order; the chunks run concurrently on the workers."""
        calls = self._submit(samples)

        async def wait(worker: int, names: list[str], ref: Any) -> list[float]:
            try:
                return await asyncio.wait_for(asyncio.wrap_future(ref.future()), self.timeout_s)
            except Exception as exc:
                raise self._error(exc, worker, names) from exc

        chunks = await asyncio.gather(*(wait(*call) for call in calls))
        return [v for chunk in chunks for v in chunk]

    def score_sync(self, samples: Sequence[Sample]) -> list[float]:
        """The blocking form of `score` (ray.get with the pool's timeout)."""
        import ray

        out: list[float] = []
        for worker, names, ref in self._submit(samples):
            try:
                out += ray.get(ref, timeout=self.timeout_s)
            except Exception as exc:
                raise self._error(exc, worker, names) from exc
        return out

    def placement_info(self) -> list[dict[str, Any]]:
        import ray

        return ray.get([w.placement_info.remote() for w in self.workers])

    def shutdown(self) -> None:
        import ray

        for worker in self.workers:
            with contextlib.suppress(Exception):  # already gone
                ray.kill(worker)
        self.workers = []


def _cause(exc: BaseException) -> str:
    cause = getattr(exc, "cause", None)
    if cause is not None:
        return f"{type(cause).__name__}: {cause}"
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[-1] if text else ''}"


def reward_types_in_use(args: Any, metadata: Iterable[dict[str, Any]] = ()) -> list[str]:
    """The job's reward types plus every `metadata.rm_type` seen (sorted, deduplicated); none under
    --custom-rm-path."""
    if args.custom_rm_path:
        return []
    types = {m.get("rm_type") for m in metadata if m}
    types.update(reward_names(args))
    return sorted(t for t in types if t)


def make_reward_pools(
    args: Any, rm_types: Iterable[str] | None = None, *, register: bool = True, **pool_kwargs: Any
) -> dict[str, RewardPool]:
    """Pools for the model-backed reward types in use (default: `reward_types_in_use(args)` that are
    `ocr` / `pickscore`; pass `rm_types` to choose, any built-in type allowed). With `register`, the
    dispatch (`batched_async_rm`) scores those types on them."""
    if rm_types is None:
        rm_types = [t for t in reward_types_in_use(args) if t in POOLED_RM_TYPES]
    pools: dict[str, RewardPool] = {}
    try:
        for rm_type in dict.fromkeys(rm_types):
            pools[rm_type] = RewardPool(args, rm_type, **pool_kwargs)
    except Exception:
        shutdown_reward_pools(pools)
        raise
    if register:
        set_reward_pools(pools)
    return pools


def shutdown_reward_pools(pools: dict[str, RewardPool] | None = None) -> None:
    """Kill the pools' actors (default: every registered pool) and drop them from the dispatch registry."""
    registered = get_reward_pools()
    targets = registered if pools is None else pools
    for pool in targets.values():
        pool.shutdown()
    set_reward_pools({t: p for t, p in registered.items() if all(p is not q for q in targets.values())})
