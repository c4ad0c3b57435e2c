"""Fixtures of the model tests that condition on images (tests/conftest.py holds the session-wide ones).

digit_pngs    two digits of the embedded test split (`digits_split`) as 64x64 RGB PNGs: the kind of file a user's
              rows name as condition images (an edit's sources, a video's first frames); read-only
make_engine   `make_engine(checkpoint, **flags)`: the in-process engine (CPU) of an `rl` job on `checkpoint`,
              `ENGINE_FLAGS` updated by `flags`; made once per module for the same arguments
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from miles.rollout.engines.diffusers_engine import DiffusersEngine

# what every engine here shares: rows with one condition image each (the rules' check; not read by the engine's
# tests), 4 samples a prompt on one CPU "GPU", fp32 at 64 x 64
ENGINE_FLAGS: dict[str, Any] = {
    "prompt_data": "digits-edit:train",
    "rm_type": "digit_edit",
    "n_samples_per_prompt": 4,
    "actor_num_gpus_per_node": 1,
    "num_gpus_per_node": 1,
    "diffusion_forward_dtype": "fp32",
    "diffusion_height": 64,
    "diffusion_width": 64,
}


@pytest.fixture(scope="session")
def digit_pngs(digits_split, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    import numpy as np
    from PIL import Image

    folder = tmp_path_factory.mktemp("digit-pngs")
    paths = []
    for i in (0, 1):
        digit = (digits_split.test_x[i] * 255).round().astype(np.uint8)
        image = Image.fromarray(digit).resize((64, 64), Image.NEAREST).convert("RGB")
        paths.append(folder / f"digit{i}.png")
        image.save(paths[-1])
    return paths


@pytest.fixture(scope="module")
def make_engine() -> Callable[..., DiffusersEngine]:
    from miles.config.resolve import resolve
    from miles.rollout.engines.diffusers_engine import DiffusersEngine

    engines: dict[tuple, DiffusersEngine] = {}

    def make(checkpoint: Path, **flags: Any) -> DiffusersEngine:
        cli = {"hf_checkpoint": str(checkpoint), **ENGINE_FLAGS, **flags}
        key = tuple(sorted(cli.items()))
        if key not in engines:
            engines[key] = DiffusersEngine(resolve("rl", cli=cli).args, device="cpu")
        return engines[key]

    return make
