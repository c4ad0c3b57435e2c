"""Metrics and media logging: wandb, TensorBoard and the miles dashboard."""

from __future__ import annotations

from miles.config.catalog._common import flag_maker
from miles.config.flags import BOOL, ENUM, INT, PATH, STR, Flag

GROUP = "Logging"
_f = flag_maker(GROUP)

FLAGS: list[Flag] = [
    _f("use-wandb", BOOL, False, "Log metrics and media to Weights & Biases."),
    _f("wandb-project", STR, None, "wandb project name."),
    _f("wandb-group", STR, None, "wandb run group."),
    _f("wandb-run-id", STR, None, "wandb run id (to resume a run)."),
    _f("wandb-team", STR, None, "wandb team (entity)."),
    _f("wandb-host", STR, None, "wandb server URL."),
    _f("wandb-key", STR, None, "wandb API key."),
    _f(
        "wandb-mode",
        ENUM,
        None,
        "wandb mode; overrides the WANDB_MODE environment variable.",
        choices=("online", "offline", "disabled"),
    ),
    _f("wandb-dir", PATH, "./wandb", "Local directory for wandb files."),
    _f("disable-wandb-random-suffix", BOOL, False, "Do not append a random suffix to wandb run names."),
    _f("wandb-log-num-images", INT, 0, "Images or videos logged per rollout; 0 disables media logging.", min=0),
    _f("wandb-log-image-interval", INT, 1, "Log media every N rollouts.", min=1),
    _f("use-tensorboard", BOOL, False, "Also write TensorBoard event files under <output-dir>/tensorboard."),
    _f("tensorboard-dir", PATH, None, "Directory for TensorBoard event files (default: <output-dir>/tensorboard)."),
    _f("use-miles-dashboard", BOOL, False, "Record async phase and trajectory telemetry for the miles dashboard."),
    _f("miles-dashboard-workspace", PATH, "./miles_dashboard", "Directory the dashboard telemetry is written to."),
]
