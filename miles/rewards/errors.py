"""What every reward module says when scoring fails: `RewardError`, and the one-line names of the samples it names.
Below the dispatch, so the reward service's client (which the dispatch imports for `remote_rm`) can raise it."""

from __future__ import annotations

from collections.abc import Sequence


class RewardError(RuntimeError):
    """A reward function failed; the message names the reward type and the sample(s)."""


def describe_sample(index: int, prompt: str, limit: int = 80) -> str:
    shown = prompt if len(prompt) <= limit else prompt[: limit - 3] + "..."
    return f"sample {index} (prompt {shown!r})"


def describe_samples(names: Sequence[str]) -> str:
    if len(names) == 1:
        return names[0]
    head = ", ".join(names[:3])
    return f"{len(names)} samples: {head}" + (", ..." if len(names) > 3 else "")
