"""`python -m miles_cli` runs the `miles` command."""

from miles_cli.main import entry

entry()
