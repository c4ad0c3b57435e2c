"""The CLI reference page (`docs/reference/cli.md`), generated from the schema so it cannot drift.

    python -m miles.config.reference            # print the page
    python -m miles.config.reference --write    # write docs/reference/cli.md
    python -m miles.config.reference --check    # exit 1 when the committed page differs (the test runs this)

Every flag of the catalogue, by help panel in `--help` order: its spelling and aliases, kind, default, choices, the
jobs it applies to, its help, and the config rules that read it (found in the source of `miles/config/rules/`).
Torch-free.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from miles.config.catalog import FLAGS_BY_GROUP, GROUPS
from miles.config.flags import BOOL, ENUM, STR_LIST, TRISTATE, WEIGHTS, Flag

PAGE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "cli.md"
RULES_DIR = Path(__file__).resolve().parent / "rules"

HEADER = """# CLI reference

Generated from the flag schema (`miles/config/catalog/`) by `python -m miles.config.reference --write`; a test fails
when this page and the schema differ. Every job reads the same flags; a flag set for a job it does not apply to is
refused. The "rules" column names the config rules (`miles/config/rules/`) that read the flag: what they refuse or
derive is in their docstrings and in `miles inspect-config`.

Kinds: `int`, `float`, `str`, `path`, `bool` (`--x/--no-x`), `tristate` (unset, `--x` or `--no-x`), `enum` (one of
the choices), `str_list` (`a,b`), `int_list` (`1,2,3`), `int_range` (`lo,hi`), `json` (an object), `named_paths`
(`NAME PATH`, repeatable), `dotted` (`pkg.module.fn`), `weights` (`name=w,name=w` or a YAML mapping).
"""


def rules_reading() -> dict[str, list[str]]:
    """dest -> the rule functions (`module.function`) whose source names it as a string."""
    found: dict[str, list[str]] = {}
    for path in sorted(RULES_DIR.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            names = {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
            for name in names:
                found.setdefault(name, []).append(f"{path.stem}.{node.name}")
    return found


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _default(flag: Flag) -> str:
    if flag.default in (None, {}, []) or (flag.kind in (BOOL, TRISTATE) and flag.default is None):
        return flag.meta.get("default_text", "-")
    return f"`{flag.format(flag.default)}`"


def _kind(flag: Flag) -> str:
    if flag.kind in (ENUM, STR_LIST, WEIGHTS) and flag.choices:
        return f"{flag.kind}: " + ", ".join(f"`{c}`" for c in flag.choices)
    return flag.kind


def _spelling(flag: Flag) -> str:
    names = [flag.option]
    if flag.kind in (BOOL, TRISTATE):
        names.append(flag.negative_option())
    names += [f"--{alias}" for alias in flag.aliases]
    return " ".join(f"`{n}`" for n in names)


def render() -> str:
    rules = rules_reading()
    out = [HEADER]
    for group in GROUPS:
        flags = FLAGS_BY_GROUP[group]
        out.append(f"\n## {group}\n")
        out.append("| flag | kind | default | jobs | what | rules |")
        out.append("|---|---|---|---|---|---|")
        for flag in flags:
            jobs = ", ".join(sorted(flag.jobs)) if flag.jobs is not None else "all"
            read_by = ", ".join(f"`{r}`" for r in sorted(set(rules.get(flag.dest, []))))
            row = (_spelling(flag), _kind(flag), _default(flag), jobs, _cell(flag.help), read_by or "-")
            out.append("| " + " | ".join(_cell(c) if i else c for i, c in enumerate(row)) + " |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    page = render()
    if "--write" in argv:
        PAGE.parent.mkdir(parents=True, exist_ok=True)
        PAGE.write_text(page)
        print(f"wrote {PAGE}")
        return 0
    if "--check" in argv:
        if not PAGE.is_file() or PAGE.read_text() != page:
            print(f"{PAGE} is out of date: run `python -m miles.config.reference --write`", file=sys.stderr)
            return 1
        return 0
    sys.stdout.write(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
