"""The trainer's train-data hooks (conversion, pair expansion) and what every user hook shares.

Each flag takes a dotted path (`package.module.function`), loaded once when the trainer starts
(`miles.utils.hooks.load_function`). `Pair` is `miles.training.pairs.Pair(sample, step, slot, sigma)`
and `Sample` is `miles.core.sample.Sample`.

--custom-convert-samples-to-train-data-path  (train rl, replay: every rollout loss)
    convert(args, samples: list[Sample]) -> list[list[Pair]]
    The whole samples -> train-data conversion: one list of pairs per optimizer step. It replaces both
    the cut into `--global-batch-size` windows and the expansion below; the trainer still splits each
    step's pairs over the dp ranks and into micro-batches. Every rank calls it with the same samples,
    so it must return the same steps on every rank.

--custom-expand-samples-to-train-pairs-path  (train rl, replay: every rollout loss)
    expand(args, samples: list[Sample]) -> list[Pair]
    Just the sample -> train-pair expansion of one optimizer window, in place of the method's built-in
    one (its `pairs` in `miles.training.methods`: every recorded SDE transition for Flow-GRPO, the
    trained sigmas for DiffusionNFT). The method checks every pair a hook returns (its `pair_problem`):
    a Flow-GRPO pair must name a recorded transition (`sample.trajectory.sde_step_indices[slot] == step`),
    a DiffusionNFT pair needs its `sigma`, a DPO pair its `sigma` and its `partner` (the loser; `sample` wins).

The hooks of `--loss-type custom_loss` itself (`--custom-prepare-train-batch-path`,
`--custom-loss-function-path`) belong to its method: `miles.training.methods.custom`.

A hook that returns something else raises `HookError`, one line naming the flag and the hook.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from miles.core.sample import Sample
from miles.training.pairs import Pair, windows
from miles.utils.hooks import load_function

CONVERT_FLAG = "--custom-convert-samples-to-train-data-path"
EXPAND_FLAG = "--custom-expand-samples-to-train-pairs-path"


class HookError(ValueError):
    """A user hook returned something the trainer cannot use."""


@dataclass
class Hook:
    flag: str
    path: str
    fn: Callable[..., Any]

    def __call__(self, *args: Any) -> Any:
        try:
            return self.fn(*args)
        except HookError:
            raise
        except Exception as exc:  # the user's code raised: one line naming the hook, the traceback in the log
            from miles.utils.actors import log_hint

            detail = (str(exc).strip().splitlines() or [""])[-1]
            raise self.fail(f"raised {type(exc).__name__}: {detail}{log_hint()}") from exc

    def fail(self, what: str) -> HookError:
        return HookError(f"{self.flag} {self.path!r} {what}")


def load_hook(args: Any, dest: str, flag: str) -> Hook | None:
    path = getattr(args, dest, None)
    return Hook(flag, path, load_function(path, flag)) if path else None


class TrainHooks:
    """The hooks of one trainer (None where the flag is unset), with their return values checked."""

    def __init__(self, args: Any) -> None:
        self.args = args
        self.convert = load_hook(args, "custom_convert_samples_to_train_data_path", CONVERT_FLAG)
        self.expand = load_hook(args, "custom_expand_samples_to_train_pairs_path", EXPAND_FLAG)

    # ---- samples -> train data -------------------------------------------------------------
    def train_data(
        self,
        samples: Sequence[Sample],
        expand: Callable[[list[Sample]], list[Pair]],
        pair_problem: Callable[[Pair], str],
    ) -> Iterator[list[Pair]]:
        """The pairs of each optimizer step, lazily (the method's built-in `expand` may draw from the trainer's
        RNG); a hook's pairs are checked with the method's `pair_problem`."""
        if self.convert is not None:
            steps = self.convert(self.args, list(samples))
            if not isinstance(steps, (list, tuple)):
                raise self.convert.fail(f"returned {kind(steps)}; expected a list of steps, each a list of Pair")
            for i, step in enumerate(steps):
                yield _check_pairs(step, self.convert, f"step {i}", pair_problem)
            return
        for window in windows(samples, self.args):
            if self.expand is None:
                yield expand(window)
            else:
                yield _check_pairs(self.expand(self.args, window), self.expand, "", pair_problem)


def _check_pairs(pairs: Any, hook: Hook, where: str, pair_problem: Callable[[Pair], str]) -> list[Pair]:
    at = f" ({where})" if where else ""
    if not isinstance(pairs, (list, tuple)):
        raise hook.fail(f"returned {kind(pairs)}{at}; expected a list of miles.training.pairs.Pair")
    for i, pair in enumerate(pairs):
        if not isinstance(pair, Pair) or not isinstance(pair.sample, Sample):
            raise hook.fail(f"returned {kind(pair)} as pair {i}{at}; expected a Pair of a Sample")
        problem = pair_problem(pair)
        if problem:
            raise hook.fail(f"returned an unusable pair {i}{at} (sample {pair.sample.index}): {problem}")
    return list(pairs)


def kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    text = repr(value)
    return f"{type(value).__name__} {text[:60] + '...' if len(text) > 60 else text}"
