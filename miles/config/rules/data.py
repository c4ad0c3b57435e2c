"""Model, data, reward and evaluation rules."""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles.config.jobs import jobs_where
from miles.config.resolution import Resolution

if TYPE_CHECKING:
    from miles.config.jobs import JobSpec


def check_model(res: Resolution, job: JobSpec) -> None:
    if res["hf_checkpoint"] is None:
        res.fail(f"--hf-checkpoint is required by `miles {job.command}` (a diffusers pipeline: repo id or directory)")
    if res["diffusion_model_family"] is not None and res["train_pipeline_config_path"] is not None:
        res.fail(
            f"{res.show('diffusion_model_family')} and {res.show('train_pipeline_config_path')} "
            "are mutually exclusive: name a registered family or give your own TrainPipelineConfig"
        )
    family = _resolve_family(res, job)
    if family is not None:
        family.check_settings(res, job)  # the family's own rules (guidance, experts, ...)
        _check_builtin_media(res, family)
        _check_sourced_rewards(res, family)
        if res["diffusion_model_family"] is None:
            # resolved once, here: every later reader (the rules, the engines, the trainers, the memory plan)
            # looks the family up by name instead of matching the checkpoint again
            res.derive("diffusion_model_family", family.name)


def _resolve_family(res: Resolution, job: JobSpec):
    """The model family's config, when the family registry is importable (it is torch-free)."""
    try:
        from miles.models.families import resolve_family
    except ImportError:  # pragma: no cover - the registry ships with the package
        return None
    if res["train_pipeline_config_path"] is not None:
        return None  # a user class: imported by the runtime, not at parse time
    config = resolve_family(
        res["hf_checkpoint"],
        family=res["diffusion_model_family"],
        config_path=None,
        require_trainable=job.trains,
    )
    return config


def _check_builtin_media(res: Resolution, family) -> None:
    """A built-in data set's rows carry as many condition images as the model takes (a user's file is checked row
    by row by the preflight)."""
    from miles.builtin.names import DATASET_CONDITION_IMAGES, parse_dataset

    low, high = family.condition_images
    specs = [("prompt_data", res["prompt_data"])] + [
        ("eval_prompt_data", spec) for spec in (res["eval_prompt_data"] or {}).values()
    ]
    for dest, spec in specs:
        parsed = parse_dataset(spec) if spec is not None else None
        if parsed is None:
            continue
        count = DATASET_CONDITION_IMAGES.get(parsed[0], 0)
        if high == 0 and count:
            res.fail(
                f"{res.show(dest)}: its rows carry {count} condition image(s) (an edit task) and model family "
                f"{family.name!r} generates from text alone; use a family that edits (flux_kontext, ...)"
            )
        if not low <= count <= high:
            res.fail(
                f"{res.show(dest)}: its rows carry no condition image and model family {family.name!r} edits one "
                "per row; use an edit data set (digits-edit:train, ...) or rows with media"
            )


def _check_sourced_rewards(res: Resolution, family) -> None:
    """A reward that scores an edit against its source (`RewardType.sourced`) needs a model that takes one: with a
    text-to-image family no sample would carry a source, and the first scoring would fail mid-run."""
    from miles.rewards import REWARD_TYPES

    if family.condition_images != (0, 0):
        return
    names, shown = _reward_names(res)
    for name in names:
        if name in REWARD_TYPES and REWARD_TYPES[name].sourced:
            res.fail(
                f"{shown}: {name} scores an edit against its source image, and model family {family.name!r} takes "
                "none; use it with a family that edits (flux_kontext, ...)"
            )


def check_prompt_data(res: Resolution, job: JobSpec) -> None:
    if not job.needs_prompt_data or res["prompt_data"] is not None:
        return
    if res["data_source_path"] is not None or res["disable_rollout_global_dataset"]:
        return
    if res["load_debug_rollout_data"] is not None:
        return
    res.fail(f"--prompt-data is required by `miles {job.command}` (a JSONL file, one prompt per line)")


REMOTE_FLAGS = ("rm_remote_name", "rm_batch_size", "rm_max_in_flight", "rm_timeout", "rm_retries", "rm_fault_wait")


def _reward_names(res: Resolution) -> tuple[list[str], str]:
    """The job's reward types (`--reward-weights`' names, else `--rm-type`) and the flag to name in a message."""
    weights = res["reward_weights"]
    if weights is not None:
        return list(weights), res.show("reward_weights")
    return list(res["rm_type"] or []), res.show("rm_type")


def check_reward(res: Resolution, job: JobSpec) -> None:
    """The job's rewards (`--rm-type`, `--reward-weights`): each type's required flags, and weights that name the
    same types as `--rm-type` when both are given."""
    from miles.rewards import REWARD_TYPES

    types, weights = res["rm_type"], res["reward_weights"]
    if types is not None and weights is not None and set(types) != set(weights):
        res.fail(
            f"{res.show('rm_type')} and {res.show('reward_weights')} name different rewards: give the weights alone "
            "(their names are the reward types), or the same types in both"
        )
    if types is not None and len(set(types)) != len(types):
        res.fail(f"{res.show('rm_type')}: a reward type is given twice")
    names, shown = _reward_names(res)
    for name in names:
        missing = ["--" + dest.replace("_", "-") for dest in REWARD_TYPES[name].required if res[dest] is None]
        if missing:
            res.fail(f"{shown}: {name} requires {' and '.join(missing)}")
    remote = [d for d in REMOTE_FLAGS if res.explicit(d)]
    if remote and "remote_rm" not in names:
        res.fail(f"{res.show(remote[0])} configures the remote reward client: it needs remote_rm among the rewards")
    if res["reward_component_norm"] != "none" and len(names) < 2:
        res.fail(
            f"{res.show('reward_component_norm')} normalises each of several rewards: give two or more with "
            "--rm-type a,b or --reward-weights"
        )
    skipped = res["train_only"] or res["load_debug_rollout_data"] is not None
    if job.scores and not skipped and not names and res["custom_rm_path"] is None:
        res.fail(f"`miles {job.command}` scores samples: set --rm-type or --custom-rm-path")


def check_eval(res: Resolution, job: JobSpec) -> None:
    """Eval data is evaluated or said not to be (`miles.config.eval_schedule`): a training job evaluates it after
    its last rollout, and every --eval-interval N; training on saved rollouts starts no engine, so a warning."""
    from miles.config.eval_schedule import evaluates, has_eval_data, not_evaluated_reason, trains_on_saved_rollouts

    data = has_eval_data(res)
    if res["eval_interval"] is not None and not data:
        res.fail(f"{res.show('eval_interval')} requires eval datasets: --eval-prompt-data NAME PATH or --eval-config")
    if job.needs_eval_data and not data:
        res.fail(f"`miles {job.command}` needs eval datasets: --eval-prompt-data NAME PATH or --eval-config")
    if job.trains_on_dataset and evaluates(res, job.name) and res["rollout_backend"] == "sglang":
        res.fail(
            f"{res.show('rollout_backend')}: `miles {job.command}` evaluates its eval sets on one in-process "
            "diffusers engine; use --rollout-backend diffusers"
        )
    reason = not_evaluated_reason(res, job.name) if job.trains else None
    if reason is not None:
        if res["eval_interval"] is not None and not trains_on_saved_rollouts(res, job.name):
            res.not_applicable("eval_interval", f"nothing is evaluated: {reason}")
        elif res["eval_interval"] is None:
            which = "eval_config" if res["eval_config"] is not None else "eval_prompt_data"
            res.warn(f"{res.show(which)} is not evaluated: {reason}")


def check_debug_modes(res: Resolution, job: JobSpec) -> None:
    if res["train_only"] and res["debug_rollout_only"]:
        res.fail(f"{res.show('train_only')} and {res.show('debug_rollout_only')} exclude each other")
    if res["train_only"] and job.generates and res["load_debug_rollout_data"] is None:
        res.fail(
            f"{res.show('train_only')} starts no engines, so `miles {job.command}` needs --load-debug-rollout-data "
            "(a saved rollout to train on)"
        )
    if res["load_debug_rollout_data_subsample"] is not None and res["load_debug_rollout_data"] is None:
        res.fail(f"{res.show('load_debug_rollout_data_subsample')} requires --load-debug-rollout-data")
    _check_debug_dumps(res, job)


def _check_debug_dumps(res: Resolution, job: JobSpec) -> None:
    """`--dump-details DIR` fills the dump paths this job writes (`DIR/rollout_data/{rollout_id}.pt`,
    `DIR/train_data/{rollout_id}.pt`) unless set; a dump the job never writes is refused."""
    # a job that would start engines trains on saved rollouts instead (`train rl --load-debug-rollout-data`)
    if job.starts_engines and job.trains_on_rollouts and res["load_debug_rollout_data"] is not None:
        if res["eval_interval"] is not None:
            res.not_applicable("eval_interval", "training on saved rollouts starts no engine to evaluate with")
        if res["debug_rollout_only"]:
            res.fail(f"{res.show('debug_rollout_only')} and --load-debug-rollout-data exclude each other")
    if res["load_debug_rollout_data"] is not None and not job.trains_on_rollouts:
        res.fail(f"{res.show('load_debug_rollout_data')}: `miles {job.command}` trains on no saved rollout")
    if res["debug_rollout_only"] and not job.has_rollout_only_mode:
        res.fail(f"{res.show('debug_rollout_only')}: `miles {job.command}` has no rollout-only mode")
    if res["save_debug_rollout_data"] is not None and not job.dumps_rollouts:
        res.fail(f"{res.show('save_debug_rollout_data')}: `miles {job.command}` makes no rollouts to save")
    if res["save_debug_train_data"] is not None and not job.dumps_train_data:
        does = ", ".join(j.command for j in jobs_where(lambda j: j.dumps_train_data))
        res.fail(f"{res.show('save_debug_train_data')}: `miles {job.command}` saves no train data ({does} does)")
    folder = res["dump_details"]
    if folder is None:
        return
    if not job.dumps_rollouts:
        writers = ", ".join(j.command for j in jobs_where(lambda j: j.dumps_rollouts))
        res.fail(f"{res.show('dump_details')}: `miles {job.command}` writes no debug dumps ({writers})")
    root = str(folder).rstrip("/")
    if res["save_debug_rollout_data"] is None:
        res.derive("save_debug_rollout_data", f"{root}/rollout_data/{{rollout_id}}.pt")
    if job.dumps_train_data and res["save_debug_train_data"] is None:
        res.derive("save_debug_train_data", f"{root}/train_data/{{rollout_id}}.pt")


def check_checkpointing(res: Resolution, job: JobSpec) -> None:
    if res["save_interval"] is not None and res["save"] is None:
        res.fail(f"{res.show('save_interval')} requires --save (where to write checkpoints)")
    if res["ckpt_step"] is not None and res["load"] is None:
        res.fail(f"{res.show('ckpt_step')} requires --load (which checkpoint directory to read)")


RULES = (check_model, check_prompt_data, check_reward, check_eval, check_debug_modes, check_checkpointing)
