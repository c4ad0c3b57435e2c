"""Per-component reward metrics of a multi-reward job: `<prefix>/<type>/raw_mean` and `raw_std` for each reward
type the samples were scored with (`Sample.reward_components`); nothing for a one-reward job."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from miles.core.sample import Sample


def component_metrics(prefix: str, samples: Sequence[Sample]) -> dict[str, float]:
    """`{prefix}/{type}/raw_mean` and `_std` over the samples that carry that component."""
    values: dict[str, list[float]] = {}
    for sample in samples:
        for name, value in (sample.reward_components or {}).items():
            values.setdefault(name, []).append(float(value))
    out: dict[str, float] = {}
    for name in sorted(values):
        got = values[name]
        out[f"{prefix}/{name}/raw_mean"] = statistics.fmean(got)
        out[f"{prefix}/{name}/raw_std"] = statistics.pstdev(got) if len(got) > 1 else 0.0
    return out
