"""Job-level flags: where a run reads extra config from and where it writes its outputs."""

from __future__ import annotations

from miles.config.catalog._common import flag_maker
from miles.config.flags import BOOL, FLOAT, PATH, Flag

GROUP = "Job"
_f = flag_maker(GROUP)

FLAGS: list[Flag] = [
    _f(
        "custom-config-path",
        PATH,
        text=(
            "YAML file applied after the command line; a key naming a flag overrides that flag "
            "(with a logged warning), so the YAML wins."
        ),
    ),
    _f(
        "output-dir",
        PATH,
        text=(
            "Where the run writes its resolved config, metrics.jsonl, images and default checkpoints. "
            "Default: runs/<job>-<timestamp>."
        ),
        meta={"default_text": "runs/<job>-<timestamp>"},
    ),
    _f(
        "verbose",
        BOOL,
        False,
        "Show Ray's and every actor's own output on the terminal too. Without it they go to <output-dir>/logs/ "
        "(driver.log, <role>-<index>.log) and the terminal shows the tables, the plan, progress and errors.",
    ),
    _f(
        "hook-timeout",
        FLOAT,
        1800.0,
        "Seconds a reward call or a custom hook (--custom-*-path, filters, loss) may take before the job ends "
        "with one line naming it; the default leaves room to score a batch of videos. 0 disables.",
        min=0,
    ),
]
