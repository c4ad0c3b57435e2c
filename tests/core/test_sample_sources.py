"""`Sample.sources` (the decoded condition images of a prompt row) travels in rollout files as plain tensors: a
round trip through `torch.save` / `torch.load(weights_only=True)` keeps it, and a row written before the field
existed loads with None."""

from __future__ import annotations

import io
from pathlib import Path

import torch

from miles.core.sample import Sample
from miles.io.rollout_file import load_rollout, save_rollout


def _sample(sources: list[torch.Tensor] | None) -> Sample:
    gen = torch.Generator().manual_seed(0)
    return Sample(
        index=0,
        group_index=0,
        prompt="change the 3 into a 5",
        image=torch.rand(3, 8, 8, generator=gen),
        sources=sources,
    )


def _round_trip(row: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(row, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_sources_round_trip_through_weights_only_load() -> None:
    sources = [torch.rand(3, 8, 8), torch.rand(3, 16, 12)]
    again = Sample.from_dict(_round_trip(_sample(sources).to_dict()))
    assert again.sources is not None and len(again.sources) == 2
    for a, b in zip(again.sources, sources, strict=True):
        assert torch.equal(a, b)
    assert Sample.from_dict(_round_trip(_sample(None).to_dict())).sources is None


def test_rollout_files_keep_sources_and_old_rows_load(tmp_path: Path) -> None:
    source = torch.rand(3, 8, 8)
    path = save_rollout(tmp_path / "r.pt", 0, [_sample([source]), _sample(None)])
    _, (with_source, without), _ = load_rollout(path)
    assert torch.equal(with_source.sources[0], source) and without.sources is None

    old = _sample(None).to_dict()
    del old["sources"]  # a rollout file from before the field
    assert Sample.from_dict(_round_trip(old)).sources is None
