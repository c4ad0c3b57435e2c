"""docs/extending.md's "Add a family" walkthrough is a working family: its code block, run as written, registers a
family that the checkpoint name and the CLI select and whose guided forward is the documented rescale."""

from __future__ import annotations

import importlib
import re
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from miles.models import families
from miles.models.families import resolve_family

PAGE = Path(__file__).resolve().parents[2] / "docs" / "extending.md"


@pytest.fixture
def walkthrough(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    """The page's family block saved as `my_families.py` on the path and imported, as the page tells a user."""
    section = PAGE.read_text(encoding="utf-8").split("## Add a family", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)
    (tmp_path / "my_families.py").write_text(code, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_families", raising=False)
    families._ensure_builtins()
    monkeypatch.setattr(families, "_REGISTRY", dict(families._REGISTRY))  # the registration ends with the test
    module = importlib.import_module("my_families")
    yield module
    sys.modules.pop("my_families", None)


def test_the_walkthrough_family_is_selected_by_name_and_by_the_flag(walkthrough, capsys) -> None:
    from miles_cli.main import main

    assert type(resolve_family("my-org/tiny-sd3-rescaled", env={})) is walkthrough.RescaledSD3
    assert resolve_family("my-org/tiny-sd3", env={}).name == "sd3"  # the built-in keeps its own names
    assert resolve_family(None, family="sd3_rescaled", env={}).name == "sd3_rescaled"
    argv = ["inspect-config", "--recipe", "tiny-digits-grpo"]
    assert main([*argv, "--train-pipeline-config-path", "my_families.RescaledSD3"]) == 0
    assert "my_families.RescaledSD3" in capsys.readouterr().out


def test_the_walkthrough_familys_guided_forward_is_the_rescaled_cfg(walkthrough) -> None:
    from miles.builtin.tiny.sd3 import make_transformer

    model = make_transformer(0).eval()
    cfg = model.config
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, cfg.in_channels, cfg.sample_size, cfg.sample_size, generator=gen)
    t = torch.tensor([700.0, 300.0])

    def cond() -> dict[str, torch.Tensor]:
        return {
            "encoder_hidden_states": torch.randn(2, 6, cfg.joint_attention_dim, generator=gen),
            "pooled_projections": torch.randn(2, cfg.pooled_projection_dim, generator=gen),
        }

    pos, neg = cond(), cond()
    family, plain = walkthrough.RescaledSD3(), resolve_family(None, family="sd3", env={})
    with torch.no_grad():
        ours = family.guided_velocity(model, x, t, pos, neg, 4.0)
        v_pos = plain.forward_velocity(model, x, t, pos).float()
        v_neg = plain.forward_velocity(model, x, t, neg).float()
        guided = plain.guided_velocity(model, x, t, pos, neg, 4.0)
    assert torch.allclose(guided, v_neg + 4.0 * (v_pos - v_neg), atol=1e-5)
    std = lambda v: v.std(dim=(1, 2, 3), keepdim=True)  # noqa: E731
    expected = 0.7 * guided * (std(v_pos) / std(guided)) + 0.3 * guided
    assert torch.allclose(ours, expected, atol=1e-5)
    assert not torch.allclose(ours, guided, atol=1e-3)  # the override is what the engines and the trainer run
