"""The reward-hacking guard of `miles train rl` (`--reward-guard`): it watches what the training proxy cannot see
and acts when the policy starts to exploit the proxy.

Signals, logged as `guard/...` whenever a gold reward is configured (`--gold-rm-type`):
  * `guard/gold_reward`: the mean over the eval sets of `eval/<name>/gold_reward_mean`, the held-out gold reward on
    the eval prompts (`miles.rollout.gold`); `guard/best_gold_reward` and `guard/best_rollout` the best so far;
  * `guard/diversity`: the rollout's `rollout/diversity` (`miles.rollout.diversity`) as a fraction of the first
    rollout's, the intra-group diversity a collapsing policy loses;
  * `guard/ratio_bias`: the trainer's ratio bias, `train/ratio_bias` under GRPO-Guard (the vanilla log-ratio's
    bias that RatioNorm removes), else `1 - train/ratio_mean` (Flow-GRPO's left-shifted ratio).

It acts on the first two. An evaluation whose gold reward is below the best by more than
`--reward-guard-tolerance` counts against the policy; `--reward-guard-patience` of them in a row, or a rollout whose
diversity falls below `--reward-guard-min-diversity` of the first one's, trigger the policy:
  * `warn`: one line on the terminal (`miles: warning: reward guard: ...`), and training goes on;
  * `stop`: the line, then the job ends as if it had reached `--num-rollout` (final evaluation, export);
  * `rollback`: the line, the trainer (and the engines) go back to the weights of the best gold reward, and the
    job ends there; those weights are what the job exports. Whenever the guard runs under `rollback` the export is
    that checkpoint, also when nothing triggered but the last evaluation is not the best.

The weights of each new best evaluation are saved (the trainer's checkpoint, optimizer included, written atomically)
to `<output-dir>/reward_guard/best`, replacing the previous best; the guard's own state rides along in every
`--save` checkpoint, so a resumed job keeps its best and its count.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

BEST_DIR = "reward_guard/best"
BEST_STEP = 0  # the best checkpoint is always this step of BEST_DIR, replaced atomically


@dataclass
class GuardState:
    best_gold: float | None = None
    best_rollout: int | None = None  # the rollout id whose evaluation gave the best (weights trained before it)
    below: int = 0  # evaluations in a row below the best by more than the tolerance
    first_diversity: float | None = None
    diversity_low: bool = False  # the last rollout's diversity was below --reward-guard-min-diversity
    triggered: str = ""  # why the policy was last triggered ('' while it has not been)


def gold_of(metrics: dict[str, float]) -> float | None:
    """The mean of every eval set's `gold_reward_mean` in `metrics` (None when there is none)."""
    values = [v for k, v in metrics.items() if k.startswith("eval/") and k.endswith("/gold_reward_mean")]
    return statistics.fmean(values) if values else None


def ratio_bias_of(metrics: dict[str, float]) -> float | None:
    if "train/ratio_bias" in metrics:
        return float(metrics["train/ratio_bias"])
    if "train/ratio_mean" in metrics:
        return 1.0 - float(metrics["train/ratio_mean"])
    return None


class RewardGuard:
    """The guard's decisions (no Ray, no torch): fed the metrics of each evaluation and rollout."""

    def __init__(self, policy: str, patience: int, tolerance: float, min_diversity: float | None) -> None:
        self.policy, self.patience, self.tolerance, self.min_diversity = policy, patience, tolerance, min_diversity
        self.state = GuardState()

    @classmethod
    def from_args(cls, args: Any) -> RewardGuard | None:
        if not args.gold_rm_type and args.reward_guard == "off":
            return None
        return cls(
            args.reward_guard,
            int(args.reward_guard_patience),
            float(args.reward_guard_tolerance),
            args.reward_guard_min_diversity,
        )

    @property
    def acts(self) -> bool:
        return self.policy != "off"

    def observe_eval(self, rollout_id: int, metrics: dict[str, float]) -> tuple[dict[str, float], bool, str]:
        """One evaluation's metrics: (the guard's metrics, whether it is a new best, why it triggers or '')."""
        gold = gold_of(metrics)
        if gold is None:
            return {}, False, ""
        s = self.state
        new_best = s.best_gold is None or gold > s.best_gold
        if new_best:
            s.best_gold, s.best_rollout, s.below = gold, rollout_id, 0
        elif gold < s.best_gold - self.tolerance:  # type: ignore[operator]
            s.below += 1
        else:
            s.below = 0
        why = ""
        if s.below == self.patience:  # said once per fall: again only after a recovery
            why = (
                f"the gold reward fell to {gold:.4f} from its best {s.best_gold:.4f} (at rollout {s.best_rollout}) "
                f"for {s.below} evaluations in a row (--reward-guard-patience {self.patience}, "
                f"--reward-guard-tolerance {self.tolerance})"
            )
        out = {
            "guard/gold_reward": gold,
            "guard/best_gold_reward": float(s.best_gold),  # type: ignore[arg-type]
            "guard/best_rollout": float(s.best_rollout),  # type: ignore[arg-type]
            "guard/evals_below_best": float(s.below),
        }
        return out, new_best, self._trigger(why)

    def observe_rollout(self, metrics: dict[str, float]) -> tuple[dict[str, float], str]:
        """One rollout's metrics: (the guard's metrics, why it triggers or '')."""
        out: dict[str, float] = {}
        bias = ratio_bias_of(metrics)
        if bias is not None:
            out["guard/ratio_bias"] = bias
        diversity = metrics.get("rollout/diversity")
        why = ""
        if diversity is not None:
            s = self.state
            if s.first_diversity is None:
                s.first_diversity = float(diversity)
            relative = float(diversity) / s.first_diversity if s.first_diversity > 0 else 1.0
            out["guard/diversity"] = relative
            low = self.min_diversity is not None and relative < self.min_diversity
            if low and not s.diversity_low:  # said once per collapse: again only after a recovery
                why = (
                    f"the rollout's diversity fell to {relative:.3f} of the first rollout's "
                    f"(--reward-guard-min-diversity {self.min_diversity})"
                )
            s.diversity_low = low
        return out, self._trigger(why)

    def _trigger(self, why: str) -> str:
        if why and self.acts:
            self.state.triggered = why
            return why
        return ""

    def state_dict(self) -> dict[str, Any]:
        return asdict(self.state)

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state:
            self.state = GuardState(**state)


class GuardRunner:
    """The guard inside the `train rl` loop: saves each new best (under `rollback`), says what triggered, ends the
    loop under `stop` and `rollback`, and puts the best weights back before the export under `rollback`."""

    def __init__(self, guard: RewardGuard, out: Path) -> None:
        self.guard = guard
        self.best_dir = out / BEST_DIR
        self.ended = False  # stop or rollback triggered: the loop ends
        self.current_is_best = False  # the trainer holds the weights of the best evaluation

    def after_eval(self, rollout_id: int, metrics: dict[str, float], group: Any, awake: Any) -> dict[str, float]:
        out, new_best, why = self.guard.observe_eval(rollout_id, metrics)
        self.current_is_best = new_best
        if new_best and self.guard.policy == "rollback":
            with awake():
                group.call("save_checkpoint", str(self.best_dir), BEST_STEP, {"rollout_id": rollout_id - 1})
        self._act(why)
        return out

    def after_rollout(self, metrics: dict[str, float]) -> dict[str, float]:
        self.current_is_best = False  # a rollout trained: the weights moved on from the last evaluation's
        out, why = self.guard.observe_rollout(metrics)
        self._act(why)
        return out

    def _act(self, why: str) -> None:
        if not why or self.ended:
            return
        policy = self.guard.policy
        then = {
            "warn": "training goes on",
            "stop": "the job ends here",
            "rollback": f"back to the weights evaluated at rollout {self.guard.state.best_rollout}, and the job ends",
        }[policy]
        print(f"miles: warning: reward guard ({policy}): {why}; {then}", flush=True)
        self.ended = policy in ("stop", "rollback")

    def restore_best(self, group: Any, sync: Any, awake: Any) -> bool:
        """Under `rollback`, put the best gold checkpoint back into the trainer and (`sync()`) the engines, unless
        the trainer holds those weights already; True when it restored them."""
        state = self.guard.state
        if self.guard.policy != "rollback" or self.current_is_best or state.best_rollout is None:
            return False
        if not self.best_dir.is_dir():
            return False
        with awake():
            group.call("load_checkpoint", str(self.best_dir), BEST_STEP)
        sync()
        self.current_is_best = True
        print(
            f"miles: reward guard: restored the weights of the best gold reward {state.best_gold:.4f} "
            f"(evaluated at rollout {state.best_rollout})",
            flush=True,
        )
        return True
