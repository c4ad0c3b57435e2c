"""Errors raised while resolving a job's arguments (torch-free)."""

from __future__ import annotations


class ConfigError(Exception):
    """A user mistake in flags, a recipe or a YAML file.

    The CLI prints it as one line and exits with code 2 (a usage error), with no traceback.
    The message names the flag, file, line or key and the offending values.
    """


class RuntimeUnavailable(Exception):
    """The job's runtime is not built yet (exit code 3)."""
