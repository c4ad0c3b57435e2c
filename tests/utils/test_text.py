"""Error messages quote user data clipped (miles.utils.text), and the CLI bounds every message it prints."""

from __future__ import annotations

import pytest

from miles.core.errors import ConfigError
from miles.utils.text import LINE, LINES, bounded, clip, clip_repr, first_line


def test_clip_keeps_what_fits_and_says_how_long_the_rest_was() -> None:
    assert clip("short") == "short"
    assert clip("x" * 1000, 10) == "xxxxxxx... (1,000 chars)"
    assert clip_repr("y" * 500, 5) == "'yyyyy'... (500 chars)"
    assert clip_repr(list(range(300)), 80) == "a list of 300 items"


def test_first_line_is_the_clipped_head_of_a_message() -> None:
    assert first_line(KeyError("label")) == "'label'"
    assert first_line(ValueError("  bad row\n  at line 3")) == "bad row"
    assert first_line(ValueError("")) == ""
    assert first_line("k" * 1000) == "k" * 197 + "... (1,000 chars)"


def test_bounded_clips_each_line_and_the_number_of_lines() -> None:
    assert bounded("3 problems:\n  - a\n  - b\n  - c") == "3 problems:\n  - a\n  - b\n  - c"
    line = bounded("z" * 1_000_000)
    assert len(line) < LINE + 40 and line.endswith("... (1,000,000 chars)")
    many = bounded("\n".join(f"  - problem {i}" for i in range(500)))
    lines = many.splitlines()
    assert len(lines) == LINES + 1 and lines[-1] == f"  ... and {500 - LINES:,} more lines"


def test_the_cli_never_prints_a_message_in_bulk(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """Whatever a check raises, the terminal gets at most LINES lines of at most about LINE characters."""
    import miles_cli.main as cli

    def huge(*_args, **_kwargs):
        raise ConfigError("--prompt-data rows.jsonl:1: " + "q" * 200_000 + "\n" * 3 + "tail\n" * 1000)

    monkeypatch.setattr(cli, "app", huge)
    assert cli.main(["inspect-config"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("miles: error: --prompt-data rows.jsonl:1: qqq") and "(200,028 chars)" in err
    assert len(err.splitlines()) == LINES + 1 and max(len(line) for line in err.splitlines()) < LINE + 60
