"""CI metric checks, used by tests/e2e (not meant for manual runs)."""

from __future__ import annotations

from miles.config.catalog._common import flag_maker
from miles.config.flags import BOOL, FLOAT, STR, Flag

GROUP = "CI"
_f = flag_maker(GROUP)

FLAGS: list[Flag] = [
    _f("ci-test", BOOL, False, "Enable the CI metric check at the end of the job (tests/e2e only)."),
    _f("ci-metric-checker-key", STR, None, "Metric the CI checker compares against its threshold."),
    _f(
        "ci-metric-checker-threshold",
        FLOAT,
        None,
        "Threshold the CI-checked metric must reach: exit 1 unless its last logged value is >= this.",
    ),
]
