"""`miles eval`: generate for the eval datasets with `--hf-checkpoint` and report their metrics.

Writes `eval/<name>/<metric>` to metrics.jsonl (rollout_id 0) and a labelled grid per dataset,
`images/eval_<name>.png` (videos: also `eval_<name>.webp`, animated, and one WebP per video).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from miles.io.dashboard import open_dashboard
from miles.io.loggers import MetricsLogger
from miles.rollout.rollout_hooks import log_eval
from miles.runtime.ci_check import ci_check
from miles.runtime.session import ray_job

if TYPE_CHECKING:
    from miles.config.resolve import ResolvedJob

GRID_MAX = 64


def save_eval_grids(args: Any, out: Any, by_name: dict[str, list[Any]], tag: str = "") -> None:
    """`images/eval_<name><tag>.png` per eval set (the captioned grid of its first GRID_MAX samples); with
    videos also the animated grid `eval_<name><tag>.webp` and one WebP per video (`eval_<name><tag>/NNNN.webp`)."""
    from miles.io.video import DEFAULT_FPS, save_samples_media

    key = args.eval_reward_key or args.reward_key
    fps = float(args.diffusion_fps or DEFAULT_FPS)
    for name, samples in by_name.items():
        shown = samples[:GRID_MAX]
        labels = [f"{s.prompt} | r={s.scalar_reward(key):.3f}" for s in shown]
        save_samples_media(out / "images", f"eval_{name}{tag}", [s.image for s in shown], labels, fps)


def run(resolved: ResolvedJob) -> int:
    import ray

    args = resolved.args
    with ray_job(resolved, args) as job:
        out = job.out
        job.record_placement()
        with open_dashboard(args, resolved.spec.name, resolved.recipe) as dash, dash.span("eval", rollout_id=0):
            metrics, by_name = ray.get(job.manager.evaluate.remote(0))
    if not log_eval(args, 0, by_name, metrics):  # a truthy --custom-eval-rollout-log-function-path skips this
        with MetricsLogger(args, out, resolved.spec.name, echo=lambda line: None) as logger:
            logger.log(0, metrics)
        save_eval_grids(args, out, by_name)
    for key, value in sorted(metrics.items()):
        print(f"{key} = {value:.4f}")
    return ci_check(args, out, job.metrics_start)
