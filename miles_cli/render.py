"""Printing resolved args: a rich table per trainer, YAML, JSON; and the recipe list."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING

from miles.config.args import DEFAULT
from miles.config.catalog import FLAGS_BY_DEST
from miles.config.export import arg_order, to_json_dict, to_yaml_text

if TYPE_CHECKING:
    from miles.config.args import Args
    from miles.config.resolve import ResolvedJob
    from miles.memory.estimate import MemoryEstimate
    from miles.placement.plan import Plan

_SOURCE_STYLE = {"default": "dim", "recipe": "cyan", "cli": "green", "yaml": "magenta", "derived": "yellow"}


def _console(stderr: bool = False):
    from rich.console import Console

    return Console(stderr=stderr, soft_wrap=False, width=None if sys.stdout.isatty() else 140)


def print_warnings(warnings: list[str]) -> None:
    for message in warnings:
        print(f"miles: warning: {message}", file=sys.stderr)


def _format_value(dest: str, value: object) -> str:
    flag = FLAGS_BY_DEST.get(dest)
    if flag is not None:
        return flag.format(value)
    return json.dumps(value, sort_keys=True) if value else "-"


def _table(role: str, command: str, args: Args, show_all: bool):
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"{role} ({command})", title_justify="left", header_style="bold")
    table.add_column("flag")
    table.add_column("value", overflow="fold")
    table.add_column("source")
    values, sources = args.to_dict(), args.sources()
    for dest in arg_order():
        source = sources[dest]
        if source == DEFAULT and not show_all:
            continue
        flag = FLAGS_BY_DEST.get(dest)
        name = flag.option if flag is not None else dest
        style = "bold red" if source.startswith("override:") else _SOURCE_STYLE.get(source, "")
        table.add_row(name, Text(_format_value(dest, values[dest])), Text(source, style=style))
    return table


def print_trainer_tables(resolved: ResolvedJob, show_all: bool = False) -> None:
    console = _console()
    header = f"miles {resolved.spec.command}"
    if resolved.recipe:
        header += f" ({resolved.recipe})"
    console.print(f"[bold]{header}[/bold]: trainers {', '.join(t.role for t in resolved.trainers)}")
    for trainer in resolved.trainers:
        console.print(_table(trainer.role, resolved.spec.command, resolved.trainer_args[trainer.role], show_all))


def print_inspect(resolved: ResolvedJob, fmt: str, show_all: bool = False) -> None:
    if fmt == "json":
        print(json.dumps(to_json_dict(resolved.spec.name, resolved.trainer_args), indent=2))
    elif fmt == "yaml":
        sys.stdout.write(to_yaml_text(resolved.args))
    else:
        print_trainer_tables(resolved, show_all=show_all)


def print_schedule(resolved: ResolvedJob) -> None:
    """What the job evaluates and when, and (an RL job) the denoising grid's trained steps as they will run."""
    from miles.config.eval_schedule import has_eval_data, schedule_text
    from miles.config.jobs import EVAL_PERIODIC
    from miles.sampling.trained_steps import plan_lines

    args, spec = resolved.args, resolved.spec
    lines = plan_lines(args, spec)
    if has_eval_data(args) or spec.evaluation == EVAL_PERIODIC:
        lines.append(f"evaluation: {schedule_text(args, spec.name)}")
    if lines:
        print("\n".join(lines))


def print_plan(plan: Plan, estimate: MemoryEstimate | None = None) -> None:
    """The placement plan: one row per GPU (node, gpu, what it holds with shares, the GPU's total; with a memory
    estimate, its peak GiB in the train, sync and rollout phases)."""
    from rich.table import Table

    from miles.memory.report import gpu_columns
    from miles.placement.render import plan_header, plan_rows

    console = _console()
    console.print(plan_header(plan), soft_wrap=True, highlight=False)
    table = Table(header_style="bold")
    columns = ["node", "gpu", "holds (share)", "total"]
    if estimate is not None:
        columns += ["train GiB", "sync GiB", "rollout GiB"]
    for column in columns:
        table.add_column(column)
    for row in plan_rows(plan):
        cells = list(row)
        if estimate is not None:
            cells += gpu_columns(estimate, int(row[0]), int(row[1]))
        table.add_row(*cells)
    console.print(table)


def print_plan_json(plan: Plan, estimate: MemoryEstimate | None = None) -> None:
    from miles.memory.report import json_rows

    print(json.dumps(json_rows(plan, estimate), indent=2))


def print_recipes() -> None:
    """One line per recipe (name, job, description); a recipe that names the curve to expect (`expect:`, the GPU
    recipes: the anchor's published numbers and their source) has it on an indented line below."""
    import textwrap

    from miles.config.layering import load_config_file
    from miles.config.recipes import shipped_recipes

    rows = []
    for name, path in shipped_recipes().items():
        cfg = load_config_file(path, f"recipe {name}")
        rows.append((name, cfg.job or "-", cfg.description, cfg.expect))
    width = max((len(r[0]) for r in rows), default=0)
    indent = "    "
    for name, job, description, expect in rows:
        print(f"{name:<{width}}  {job:<12}  {description}")
        if expect:
            print(textwrap.fill(f"expect: {expect}", 140, initial_indent=indent, subsequent_indent=indent + "  "))
