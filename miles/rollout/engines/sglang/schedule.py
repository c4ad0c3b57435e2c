"""`--diffusion-flow-shift` on sglang servers: the shift of the generation schedule (torch-free).

sglang-diffusion takes the shift as a server argument, `--flow-shift` (`pipeline_config.flow_shift`): the Wan
pipelines build their grid from it, and its scheduler loader calls `scheduler.set_shift(shift)` on the
checkpoint's scheduler. Its request has no field for it that these pipelines read (`extra_sampling_params`
`flow_shift` reaches only a few model-specific stages), so one server samples at one shift.

`set_shift` alone does not give the schedule miles samples on. miles (`TrainPipelineConfig.schedule`, as
diffusers with a checkpoint whose scheduler config says that shift) builds the scheduler *with* the shift
and with dynamic shifting off; a FlowMatchEuler scheduler built with shift 1 and then `set_shift(3)` spaces
its timesteps between the unshifted sigma_min and sigma_max (tiny-sd3, 4 steps: sigmas
1, 0.8573, 0.6007, 0.0030 instead of 1, 0.8577, 0.6022, 0.0089), and a dynamic-shift scheduler (flux,
qwen_image) ignores `set_shift`, shifting by `mu` from the image size. So a checkpoint whose scheduler config
has a `shift` is served from a view of it whose `scheduler/scheduler_config.json` says `shift` = the flag and
`use_dynamic_shifting` = false, every other entry a symlink to the checkpoint's: the server then samples on
the sigmas of the in-process engine and the trainer, and `--flow-shift` is sent too (equal, for pipelines
that read it).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

SCHEDULER_CONFIG = Path("scheduler") / "scheduler_config.json"


def flow_shift_options(flow_shift: float | None) -> dict[str, Any]:
    """The `sglang serve` options that set the shift (none when the flag is unset: the checkpoint's own)."""
    return {} if flow_shift is None else {"flow_shift": float(flow_shift)}


def scheduler_config(checkpoint: Path) -> dict[str, Any]:
    path = Path(checkpoint) / SCHEDULER_CONFIG
    return json.loads(path.read_text()) if path.is_file() else {}


def served_checkpoint(checkpoint: Path, flow_shift: float | None, root: Path) -> Path:
    """The model path to serve: `checkpoint`, or under `--diffusion-flow-shift` for a scheduler config with a
    `shift` (FlowMatchEuler) a view of it at `<root>/checkpoint-flow-shift-<shift>` with that static shift."""
    checkpoint = Path(checkpoint).resolve()
    config = scheduler_config(checkpoint)
    if flow_shift is None or "shift" not in config:
        return checkpoint
    final = Path(root) / f"checkpoint-flow-shift-{float(flow_shift):g}"
    tmp = final.with_name(f".{final.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for entry in checkpoint.iterdir():
        if entry.name != SCHEDULER_CONFIG.parent.name:
            (tmp / entry.name).symlink_to(entry)
    scheduler = tmp / SCHEDULER_CONFIG.parent
    scheduler.mkdir()
    for entry in (checkpoint / SCHEDULER_CONFIG.parent).iterdir():
        if entry.name != SCHEDULER_CONFIG.name:
            (scheduler / entry.name).symlink_to(entry)
    config.update(shift=float(flow_shift), use_dynamic_shifting=False)
    (tmp / SCHEDULER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final
