"""The `miles` command tree: argv -> schema -> print the resolved per-trainer args -> dispatch.

Nothing here imports torch or Ray; the runtime is imported only when a job really starts.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Optional

import typer

from miles.config.jobs import JOBS, JobSpec
from miles.core.errors import ConfigError, RuntimeUnavailable
from miles_cli.options import META_PANEL, build_command, given_flags, normalize_argv, split_extras

HELP = (
    "Post-train diffusion models: Flow-GRPO and DiffusionNFT (train rl), flow-matching SFT (train sft), "
    "DMD2 distillation (train dmd2), eval, rollout-only and replay. One schema of flags drives every job; "
    "`miles recipes` lists the shipped recipes."
)
EPILOG = (
    "Layering: defaults < --recipe < command-line flags < --custom-config-path YAML (the YAML wins, with a "
    "warning). Unknown --sglang-KEY VALUE flags pass through to the sglang-diffusion engines."
)
_CONTEXT = {"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": ["-h", "--help"]}

app = typer.Typer(name="miles", help=HELP, no_args_is_help=True, rich_markup_mode="rich", add_completion=True)
train_app = typer.Typer(help="Train a model: rl (Flow-GRPO / DiffusionNFT), sft, dmd2.", no_args_is_help=True)
app.add_typer(train_app, name="train", rich_help_panel="Jobs")


def _print_version(value: bool) -> None:
    if value:
        from miles import __version__

        print(f"miles {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="Print the miles version and exit."
    ),
) -> None:
    """Post-train diffusion models."""


def _kw(name: str, annotation: Any, default: Any) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)


def _ctx_param() -> inspect.Parameter:
    return inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context)


def _job_names() -> str:
    """The jobs of the table in words: `a, b or c`."""
    names = list(JOBS)
    return f"{', '.join(names[:-1])} or {names[-1]}" if len(names) > 1 else names[0]


def _meta_params(inspect_config: bool = False, plan: bool = False) -> list[inspect.Parameter]:
    params = [
        _kw(
            "recipe",
            Optional[str],  # noqa: UP045
            typer.Option(
                None, "--recipe", help="A shipped recipe name or a path to a recipe YAML.", rich_help_panel=META_PANEL
            ),
        ),
        _kw(
            "override",
            Optional[list[str]],  # noqa: UP045
            typer.Option(
                None,
                "--override",
                metavar="ROLE.KEY=VALUE",
                help="Per-trainer override, e.g. critic.lr=2e-6 (train dmd2). Repeatable.",
                rich_help_panel=META_PANEL,
            ),
        ),
        _kw(
            "show_all",
            bool,
            typer.Option(
                False,
                "--all",
                help="Print every resolved argument, not only non-defaults.",
                rich_help_panel=META_PANEL,
            ),
        ),
    ]
    if inspect_config or plan:
        params.append(
            _kw(
                "cluster",
                Optional[str],  # noqa: UP045
                typer.Option(
                    None,
                    "--cluster",
                    metavar="NxG",
                    help="Plan for N nodes with G GPUs each. Default: Ray's cluster when $RAY_ADDRESS is set "
                    "(miles plan only), else the cluster the flags describe.",
                    rich_help_panel=META_PANEL,
                ),
            )
        )
    if inspect_config:
        params.append(
            _kw(
                "check",
                bool,
                typer.Option(
                    False,
                    "--check",
                    help="Also run the preflight (model paths, data files, hooks, --load, outputs, GPUs) as a job "
                    "would before it starts; exit 2 on any problem.",
                    rich_help_panel=META_PANEL,
                ),
            )
        )
    if inspect_config or plan:
        params += [
            _kw(
                "job",
                Optional[str],  # noqa: UP045
                typer.Option(
                    None,
                    "--job",
                    help=f"{_job_names()}. Default: the recipe's.",
                    rich_help_panel=META_PANEL,
                ),
            ),
            _kw(
                "output_format",
                str,
                typer.Option(
                    "table",
                    "--format",
                    help="table or json." if plan else "table, yaml or json.",
                    rich_help_panel=META_PANEL,
                ),
            ),
        ]
    return params


def _resolve_from_cli(
    ctx: typer.Context,
    job: str | None,
    kwargs: dict[str, Any],
    replay_path: str | None = None,
    extra: dict[str, Any] | None = None,
):
    """The job the command line describes (`extra`: flags merged over it, as the memory plan's changes)."""
    from miles.config.resolve import resolve

    sglang = split_extras(ctx.args)
    return resolve(
        job,
        cli={**given_flags(ctx, kwargs), **(extra or {})},
        recipe=kwargs.get("recipe"),
        overrides=kwargs.get("override") or (),
        sglang=sglang,
        replay_path=replay_path,
    )


def _run_job(job: str, ctx: typer.Context, kwargs: dict[str, Any], replay_path: str | None = None) -> int | None:
    from miles_cli.render import print_trainer_tables, print_warnings

    resolved = _resolve_from_cli(ctx, job, kwargs, replay_path)
    print_warnings(resolved.warnings)
    print_trainer_tables(resolved, show_all=kwargs.get("show_all", False))
    from miles.preflight import passed_line, preflight

    report = preflight(resolved)  # every input checked, every problem at once, before Ray starts or a model is built
    if report.warnings:
        print(passed_line(report), file=sys.stderr)
    from miles.runtime import dispatch

    return dispatch(resolved)  # the driver's exit code (e.g. 1 when the --ci-test metric check fails)


def _job_command(spec: JobSpec):
    """The command of one row of the job table: its flags, and the rollout file it trains on when it takes one."""
    leading = [_ctx_param()]
    if spec.takes_rollout_file:

        def body(ctx: typer.Context, rollout: str, **kwargs: Any) -> int | None:
            # its exit code: a failed replay is not a pass
            return _run_job(spec.name, ctx, kwargs, replay_path=rollout)

        leading.append(
            inspect.Parameter(
                "rollout",
                inspect.Parameter.POSITIONAL_OR_KEYWORD,
                annotation=str,
                default=typer.Argument(..., metavar="ROLLOUT.pt", help="A rollout file written by a run."),
            )
        )
    else:

        def body(ctx: typer.Context, **kwargs: Any) -> int | None:
            return _run_job(spec.name, ctx, kwargs)

    body.__doc__ = spec.summary
    return build_command(body, leading, _meta_params())


def add_job_commands(root: typer.Typer, groups: Mapping[str, typer.Typer], jobs: Iterable[JobSpec]) -> None:
    """One command per job, in table order: `miles <group> <word>` under its `cli_group`, else `miles <word>` in
    the Jobs panel."""
    for spec in jobs:
        command = _job_command(spec)
        if spec.cli_group is None:
            root.command(spec.word, context_settings=_CONTEXT, rich_help_panel="Jobs")(command)
        else:
            groups[spec.cli_group].command(spec.word, context_settings=_CONTEXT)(command)


add_job_commands(app, {"train": train_app}, JOBS.values())


def _inspect_body(ctx: typer.Context, **kwargs: Any) -> None:
    """Print the resolved per-trainer args (flag, value, source) and exit."""
    from miles_cli.render import print_inspect, print_warnings

    fmt = kwargs.get("output_format", "table")
    if fmt not in ("table", "yaml", "json"):
        raise ConfigError(f"--format {fmt}: expected table, yaml or json")
    resolved = _resolve_from_cli(ctx, kwargs.get("job"), kwargs)
    from miles.placement.cluster import flags_cluster, parse_cluster

    cluster_text = kwargs.get("cluster")
    if cluster_text is not None and not cluster_text.strip():
        raise ConfigError("--cluster: empty; expected NODESxGPUS, e.g. 2x8")
    cluster = parse_cluster(cluster_text) if cluster_text else None  # checked in every --format
    print_warnings(resolved.warnings)
    print_inspect(resolved, fmt, show_all=kwargs.get("show_all", False))
    if fmt == "table":
        from miles.memory.report import memory_for
        from miles.placement.plan import make_plan
        from miles_cli.render import print_plan, print_schedule

        print_schedule(resolved)

        cluster = cluster or flags_cluster(resolved.args)
        plan = make_plan(resolved.args, cluster, resolved.spec)
        estimate, lines = memory_for(resolved, plan)
        print_plan(plan, estimate)
        _print_manager_node(resolved)
        print("\n".join(lines))
    if kwargs.get("check"):
        _check(resolved, to_stdout=fmt == "table")


def _print_manager_node(resolved: Any) -> None:
    from miles.placement.manager_node import describe

    line = describe(resolved.args, resolved.spec)
    if line:
        print(line)


def _check(resolved: Any, to_stdout: bool) -> None:
    """`inspect-config --check`: the preflight alone; ConfigError (exit 2) listing the problems."""
    from miles.preflight import passed_line, problems_message, run_checks

    report = run_checks(resolved)
    if report.problems:
        raise ConfigError(problems_message(report.problems))
    line = passed_line(report)
    print(line, file=sys.stdout if to_stdout else sys.stderr)


app.command("inspect-config", context_settings=_CONTEXT, rich_help_panel="Config")(
    build_command(_inspect_body, [_ctx_param()], _meta_params(inspect_config=True))
)


def _plan_body(ctx: typer.Context, **kwargs: Any) -> None:
    """Print where every trainer rank, engine and reward worker of the job would run: one row per GPU."""
    from miles.placement.plan import make_plan
    from miles_cli.render import print_plan, print_plan_json, print_warnings

    fmt = kwargs.get("output_format", "table")
    if fmt not in ("table", "json"):
        raise ConfigError(f"--format {fmt}: expected table or json")
    resolved = _resolve_from_cli(ctx, kwargs.get("job"), kwargs)
    print_warnings(resolved.warnings)
    cluster, fixed = _plan_cluster(resolved.args, kwargs.get("cluster"), with_source=True)
    plan = make_plan(resolved.args, cluster, resolved.spec)
    from miles.memory.report import enforce, memory_for

    estimate, lines = memory_for(resolved, plan)
    if fmt == "json":
        print_plan_json(plan, estimate)
    else:
        from miles_cli.render import print_schedule

        print_schedule(resolved)
        print_plan(plan, estimate)
        _print_manager_node(resolved)
        print("\n".join(lines))
    if estimate is not None:
        from miles.placement.cluster import flags_cluster

        def plan_for(other: Any) -> Any:  # a change of --actor-num-nodes grows a cluster the flags describe
            return make_plan(other.args, cluster if fixed else flags_cluster(other.args), other.spec)

        def reresolve(extra: dict[str, Any]) -> Any:
            return _resolve_from_cli(ctx, kwargs.get("job"), kwargs, extra=dict(extra))

        enforce(estimate, resolved, reresolve, plan_for)


def _plan_cluster(args: Any, cluster_text: str | None, with_source: bool = False) -> Any:
    """--cluster NxG; else Ray's cluster at $RAY_ADDRESS; else the cluster the flags describe (`with_source`:
    also whether the cluster is fixed, i.e. not the flags')."""
    import os

    from miles.placement.cluster import flags_cluster, parse_cluster

    if with_source:
        cluster = _plan_cluster(args, cluster_text)
        return cluster, bool(cluster_text) or cluster != flags_cluster(args)
    if cluster_text is not None and not cluster_text.strip():
        raise ConfigError("--cluster: empty; expected NODESxGPUS, e.g. 2x8")
    if cluster_text:
        return parse_cluster(cluster_text)
    if os.environ.get("RAY_ADDRESS"):
        import ray

        from miles.placement.cluster import ray_cluster

        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False, logging_level="ERROR")
        try:
            cluster = ray_cluster()
        finally:
            ray.shutdown()
        if any(node.gpus for node in cluster.nodes):
            return cluster
    return flags_cluster(args)


app.command("plan", context_settings=_CONTEXT, rich_help_panel="Config")(
    build_command(_plan_body, [_ctx_param()], _meta_params(plan=True))
)


@app.command("recipes", rich_help_panel="Config")
def recipes() -> None:
    """List the shipped recipes, one line each: name, job, description."""
    from miles_cli.render import print_recipes

    print_recipes()


def _add_sub_apps() -> None:
    """`miles models ...` and `miles data ...` (the embedded default's builders)."""
    import importlib

    for name, module in (("models", "miles_cli.models_cmd"), ("data", "miles_cli.data_cmd")):
        try:
            sub = importlib.import_module(module).app
        except ModuleNotFoundError:
            continue
        app.add_typer(sub, name=name, rich_help_panel="Embedded default")


_add_sub_apps()


def _add_reward_app() -> None:
    """`miles reward serve`: rewards as an HTTP service."""
    from miles_cli.reward_cmd import app as reward_app

    app.add_typer(reward_app, name="reward", rich_help_panel="Services")


_add_reward_app()


def _add_dashboard() -> None:
    """`miles dashboard DIR` (torch- and Ray-free: it only reads the trace files)."""
    from miles_cli.dashboard_cmd import dashboard

    app.command("dashboard", rich_help_panel="Tools")(dashboard)


_add_dashboard()


def _add_export() -> None:
    """`miles export CHECKPOINT_DIR` (torch is imported only when the export runs)."""
    from miles_cli.export_cmd import export

    app.command("export", rich_help_panel="Tools")(export)


_add_export()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: one line per user mistake, exit 2 for usage errors, 3 when the runtime is missing."""
    from typer import exceptions as typer_exc
    from typer._click import exceptions as click_exc

    from miles.utils.text import bounded

    args = normalize_argv(sys.argv[1:] if argv is None else argv)
    try:
        result = app(args, prog_name="miles", standalone_mode=False)
    except ConfigError as exc:
        print(f"miles: error: {bounded(str(exc))}", file=sys.stderr)
        return 2
    except RuntimeUnavailable as exc:
        print(f"miles: {exc}", file=sys.stderr)
        return 3
    except click_exc.NoArgsIsHelpError as exc:
        # Rich has already printed the help while the message was built; the message itself is empty.
        message = exc.format_message().strip()
        if message:
            print(message, file=sys.stderr)
        return 2
    except click_exc.UsageError as exc:
        print(f"miles: error: {bounded(_one_line(exc.format_message()))}", file=sys.stderr)
        return 2
    except typer_exc.Abort:
        print("miles: aborted", file=sys.stderr)
        return 130
    except KeyboardInterrupt:  # before the job started (a job's own Ctrl-C is handled by its driver)
        print("miles: interrupted", file=sys.stderr)
        return 130
    except typer_exc.Exit as exc:
        return int(exc.exit_code or 0)
    except Exception as exc:
        from miles.core.errors import find_engine_failure

        message = find_engine_failure(exc)
        if message is None:
            raise
        print(f"miles: error: {bounded(message)}", file=sys.stderr)
        return 1
    return int(result) if isinstance(result, int) else 0


def _one_line(text: str) -> str:
    return " ".join(text.split())


def entry() -> None:
    import miles.runtime.host_watch as host_watch

    host_watch.FORCE_EXIT = True  # the `miles` command: a driver stuck on a lost host exits (never in-process)
    sys.exit(main())
