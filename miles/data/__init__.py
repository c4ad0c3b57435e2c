"""Data sets. Built-in ones are named `NAME:PART` (e.g. `digits:train`); see `builtin`."""

from miles.data.builtin import BUILTIN_DATASETS, is_builtin_dataset, resolve_dataset

__all__ = ["BUILTIN_DATASETS", "is_builtin_dataset", "resolve_dataset"]
