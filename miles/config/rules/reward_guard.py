"""Rules of the gold reward and the reward-hacking guard (`--gold-rm-type`, `--reward-guard*`)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from miles.config.resolution import Resolution
from miles.rewards import REWARD_TYPES

if TYPE_CHECKING:
    from miles.config.jobs import JobSpec

GOLD_TYPES = tuple(name for name, t in REWARD_TYPES.items() if t.gold)
_DOTTED = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+$")
_ACTS_ON = ("reward_guard_patience", "reward_guard_tolerance", "reward_guard_min_diversity")


def check_reward_guard(res: Resolution, job: JobSpec) -> None:
    gold = res["gold_rm_type"]
    if gold is not None and gold not in GOLD_TYPES and not _DOTTED.match(str(gold)):
        res.fail(
            f"{res.show('gold_rm_type')}: not a built-in reward type ({', '.join(GOLD_TYPES)}) nor the dotted path "
            "of a reward function (pkg.module.fn, --custom-rm-path's contract)"
        )
    if gold is not None and not (res["eval_prompt_data"] or res["eval_config"]):
        res.fail(
            f"{res.show('gold_rm_type')} is scored on the evaluation samples: set --eval-prompt-data or --eval-config"
        )
    if res["reward_guard"] == "off":
        for dest in _ACTS_ON:
            if res.explicit(dest):
                res.fail(f"{res.show(dest)} tunes the reward guard, which {res.show('reward_guard')} turns off")
        return
    if gold is None:
        res.fail(f"{res.show('reward_guard')} acts on a held-out gold reward: set --gold-rm-type")
    if job.guards_rewards and not res["eval_interval"]:
        res.fail(f"{res.show('reward_guard')} reads the gold reward of each evaluation: set --eval-interval N")


RULES = (check_reward_guard,)
