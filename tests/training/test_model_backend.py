"""--model-backend-path: the trainer's DiT comes from the user's ModelBackend subclass."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from miles.config.resolution import schema_args
from miles.core.errors import ConfigError
from miles.training.model import ModelBackend, load_transformer

LOADED: list[tuple[str, torch.dtype, tuple[str, ...]]] = []


class TinyBackend(ModelBackend):
    def load_denoiser(self, checkpoint_dir: str, dtype: torch.dtype, components: tuple[str, ...]) -> torch.nn.Module:
        LOADED.append((checkpoint_dir, dtype, components))
        return torch.nn.Linear(2, 2).to(dtype)


class NotAModule(ModelBackend):
    def load_denoiser(self, checkpoint_dir: str, dtype: torch.dtype, components: tuple[str, ...]) -> Any:
        return "weights"


class Unrelated:
    pass


class FamilyThatMustNotLoad:
    def load_denoiser(self, *a: Any) -> torch.nn.Module:
        raise AssertionError("the family's loader was replaced")


def _args(path: str | None) -> SimpleNamespace:
    return schema_args(
        model_backend_path=path,
        fsdp_master_dtype="bf16",
        gradient_checkpointing=False,
        update_weight_target_module=None,
    )


def test_model_backend_replaces_the_family_loader(tmp_path: Path) -> None:
    LOADED.clear()
    model = load_transformer(_args(f"{__name__}.TinyBackend"), FamilyThatMustNotLoad(), checkpoint=tmp_path)
    assert isinstance(model, torch.nn.Linear) and model.training and model.weight.dtype == torch.bfloat16
    assert [(str(tmp_path), torch.bfloat16, ("transformer",))] == LOADED


@pytest.mark.parametrize(("name", "error"), [("NotAModule", TypeError), ("Unrelated", ConfigError)])
def test_model_backend_errors_name_the_flag(tmp_path: Path, name: str, error: type) -> None:
    with pytest.raises(error, match=r"^--model-backend-path"):
        load_transformer(_args(f"{__name__}.{name}"), FamilyThatMustNotLoad(), checkpoint=tmp_path)
