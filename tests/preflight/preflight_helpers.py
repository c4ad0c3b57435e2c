"""Helpers of the preflight tests: JSONL files and pipeline-shaped folders (configs only, no weights)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from miles.config.resolve import ResolvedJob

# the `job` fixture's type (tests import it from here: `conftest` is a name every test folder uses)
Job = Callable[..., ResolvedJob]


def write_lines(path: Path, lines: list[Any]) -> Path:
    """A JSONL file: dicts are dumped, strings written as they are."""
    text = "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines)
    path.write_text(text, encoding="utf-8")
    return path


def digit_prompts(n: int) -> list[dict[str, Any]]:
    return [{"input": f"the digit {i % 10}", "metadata": {"label": i % 10}} for i in range(n)]


def make_pipeline(folder: Path, components: tuple[str, ...] = ("scheduler", "vae", "transformer")) -> Path:
    """A diffusers-shaped pipeline folder (configs only, no weights)."""
    folder.mkdir(parents=True, exist_ok=True)
    index: dict[str, Any] = {"_class_name": "StableDiffusion3Pipeline", "feature_extractor": [None, None]}
    for name in components:
        index[name] = ["diffusers", "X"]
        (folder / name).mkdir(exist_ok=True)
        (folder / name / "config.json").write_text(json.dumps({"in_channels": 4, "sample_size": 8}))
    (folder / "model_index.json").write_text(json.dumps(index))
    return folder
