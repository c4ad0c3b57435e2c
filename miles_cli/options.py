"""Typer options built from the flag catalogue, so every subcommand takes every flag.

Each flag becomes a keyword parameter of the command function (its dest), annotated for Typer and
placed in the help panel of its group. Defaults are None on the Click side: the schema owns the
real defaults, and only flags really given on the command line reach the resolver.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any, Optional

import typer

from miles.config.catalog import ALL_FLAGS, FLAGS_BY_DEST
from miles.config.flags import BOOL, ENUM, FLOAT, INT, NAMED_PATHS, STR_LIST, TRISTATE, Flag, closest
from miles.core.errors import ConfigError

_LIST_KINDS = (STR_LIST, NAMED_PATHS)
META_PANEL = "Job"


def _escape(text: str) -> str:
    """Help text is rendered as rich markup: keep literal brackets."""
    return text.replace("[", r"\[")


def _annotation(flag: Flag) -> Any:
    if flag.kind == INT:
        return Optional[int]  # noqa: UP045 - Typer reads these annotations at run time
    if flag.kind == FLOAT:
        return Optional[float]  # noqa: UP045
    if flag.kind in (BOOL, TRISTATE):
        return Optional[bool]  # noqa: UP045
    if flag.kind in _LIST_KINDS:
        return Optional[list[str]]  # noqa: UP045
    return Optional[str]  # noqa: UP045


def _help(flag: Flag) -> str:
    text = flag.help
    if flag.kind == ENUM and flag.choices:
        text += f" One of: {', '.join(flag.choices)}."
    if flag.default not in (None, False, {}, []):
        text += f" [default: {flag.format(flag.default)}]"
    elif "default_text" in flag.meta and flag.meta["default_text"] not in text:
        text += f" [default: {flag.meta['default_text']}]"
    if flag.aliases:
        text += f" Alias: {', '.join('--' + a for a in flag.aliases)}."
    return _escape(text)


def _completer(choices: Sequence[str]) -> Callable[[str], list[str]]:
    def complete(incomplete: str) -> list[str]:
        return [c for c in choices if c.startswith(incomplete)]

    return complete


def flag_parameter(flag: Flag) -> inspect.Parameter:
    decls: list[str]
    if flag.kind in (BOOL, TRISTATE):
        decls = [f"{flag.option}/{flag.negative_option()}"]
    else:
        decls = [flag.option, *(f"--{alias}" for alias in flag.aliases)]
    if flag.kind in (BOOL, TRISTATE) and flag.aliases:
        decls += [f"--{alias}" for alias in flag.aliases]
    option = typer.Option(
        None,
        *decls,
        help=_help(flag),
        rich_help_panel=flag.group,
        show_default=False,
        metavar=flag.metavar,
        autocompletion=_completer(flag.choices) if flag.choices else None,
    )
    return inspect.Parameter(flag.dest, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=_annotation(flag))


def build_command(
    body: Callable[..., Any], leading: Sequence[inspect.Parameter], extra: Sequence[inspect.Parameter]
) -> Callable[..., Any]:
    """Give `body(**kwargs)` a signature Typer reads: leading params, every flag, then `extra`."""

    def command(**kwargs: Any) -> Any:
        return body(**kwargs)

    params = [*leading, *(flag_parameter(flag) for flag in ALL_FLAGS), *extra]
    command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in params}
    command.__doc__ = body.__doc__
    return command


def given_flags(ctx: typer.Context, kwargs: dict[str, Any]) -> dict[str, Any]:
    """dest -> raw value for the catalogue flags given on the command line."""
    given: dict[str, Any] = {}
    for dest, value in kwargs.items():
        if dest not in FLAGS_BY_DEST or value is None:
            continue
        source = ctx.get_parameter_source(dest)
        if source is not None and source.name == "COMMANDLINE":
            given[dest] = value
    return given


def normalize_argv(argv: Sequence[str]) -> list[str]:
    """Accept argparse-style multi-value flags: `--eval-prompt-data NAME PATH` and `--lora-target-modules a b c`.

    They are rewritten to the single-token forms Click parses (`NAME=PATH`, `a,b,c`).
    """
    out: list[str] = []
    i = 0
    argv = list(argv)
    while i < len(argv):
        token = argv[i]
        flag = FLAGS_BY_DEST.get(token[2:].replace("-", "_")) if token.startswith("--") and "=" not in token else None
        pair = flag is not None and flag.kind == NAMED_PATHS and _is_value(argv, i + 2)
        if pair and "=" not in argv[i + 1]:
            out += [token, f"{argv[i + 1]}={argv[i + 2]}"]
            i += 3
            continue
        if flag is not None and flag.kind == STR_LIST:
            j = i + 1
            while j < len(argv) and _is_value(argv, j):
                j += 1
            if j - i > 2:
                out += [token, ",".join(argv[i + 1 : j])]
                i = j
                continue
        out.append(token)
        i += 1
    return out


def _is_value(argv: list[str], index: int) -> bool:
    return index < len(argv) and not argv[index].startswith("-")


def split_extras(extras: Sequence[str]) -> dict[str, str]:
    """`--sglang-KEY VALUE` passthrough from the leftover tokens; anything else is an error."""
    sglang: dict[str, str] = {}
    tokens = list(extras)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token.startswith("--sglang-"):
            key, eq, value = token[len("--sglang-") :].partition("=")
            if not eq:
                if i + 1 >= len(tokens) or tokens[i + 1].startswith("--"):
                    raise ConfigError(f"{token} needs a value (--sglang-KEY VALUE)")
                value = tokens[i + 1]
                i += 1
            sglang[key.replace("-", "_")] = value
        elif token.startswith("-"):
            name = token.split("=", 1)[0]
            hint = closest(name, [flag.option for flag in ALL_FLAGS])
            suffix = f" (did you mean {hint}?)" if hint else ""
            raise ConfigError(f"no such option: {name}{suffix}")
        else:
            raise ConfigError(f"unexpected argument {token!r}")
        i += 1
    return sglang
