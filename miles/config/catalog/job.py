"""Job-level flags: where a run reads extra config from and where it writes its outputs."""

from __future__ import annotations

from miles.config.catalog._common import flag_maker
from miles.config.flags import PATH, Flag

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
]
