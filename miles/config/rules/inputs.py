"""`inputs`: the built-in names among a job's model and data flags, resolved once to where they live.

`tiny-sd3` -> `$MILES_HOME/models/tiny-sd3`, `digits:labels` -> `$MILES_HOME/data/digits/labels.jsonl`, for the
job's values and every trainer's overrides of them. `inspect-config` shows the mapping; the job's preparation
(`miles.builtin.inputs.prepare_inputs`) builds what it names, once, in the driver; everything below reads the
paths through `miles.core.inputs.input_path`. It runs first, so every later rule may read it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles.builtin.names import builtin_paths

if TYPE_CHECKING:
    from miles.config.jobs import JobSpec
    from miles.config.resolution import Resolution

# the flags whose value may be a built-in model or data set name
INPUT_FLAGS = ("hf_checkpoint", "teacher_checkpoint", "sft_encoder_checkpoint", "prompt_data", "eval_prompt_data")


def derive_inputs(res: Resolution, job: JobSpec | None = None) -> None:
    values = [res[dest] for dest in INPUT_FLAGS]
    values += [over[dest] for over in res.trainer_overrides.values() for dest in INPUT_FLAGS if dest in over]
    found = builtin_paths(values)
    if found or res["inputs"]:
        res.derive("inputs", found)


RULES = (derive_inputs,)
