"""Rollout files: round trip, refusal of non-plain objects, safe loading, templates, subsampling."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from miles.core.errors import ConfigError
from miles.core.sample import COMPLETED, Conditions, Sample, Trajectory
from miles.io.rollout_file import (
    check_serializable,
    format_rollout_path,
    load_rollout,
    save_rollout,
    subsample_rollout,
)


def make_sample(i: int, steps: int = 3) -> Sample:
    g = torch.Generator().manual_seed(i)
    trajectory = Trajectory(
        latents=torch.randn(steps + 1, 4, 2, 2, generator=g),
        timesteps=torch.linspace(1000, 100, steps),
        sigmas=torch.linspace(1, 0, steps + 1),
        sde_step_indices=[0, 1],
        log_probs=torch.randn(2, generator=g, dtype=torch.float64),
        noise_level=0.7,
    )
    conditions = Conditions(
        positive={"encoder_hidden_states": torch.randn(1, 5, 8, generator=g), "pooled_projections": torch.ones(1, 8)},
        negative={"encoder_hidden_states": torch.zeros(1, 5, 8), "pooled_projections": torch.zeros(1, 8)},
        guidance_scale=4.5,
    )
    return Sample(
        index=i,
        group_index=i // 2,
        prompt=f"the digit {i}",
        metadata={"label": i, "tags": ["a", ("b", 1)], "nested": {"x": None, "ok": True}},
        seed=42 + i,
        trajectory=trajectory,
        conditions=conditions,
        image=torch.rand(3, 8, 8, generator=g),
        reward={"digit": 0.25 * i, "aux": -1.0},
        advantage=0.5 - i,
        remove_sample=i == 1,
        status=COMPLETED,
        inference_time_s=0.125,
    )


def assert_same(a, b, where="value") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert type(a) is type(b) and a == b, where


def test_round_trip(tmp_path: Path) -> None:
    samples = [make_sample(i) for i in range(4)]
    extra = {"metrics": {"reward_mean": 0.5}, "sigmas": torch.linspace(1, 0, 4)}
    path = save_rollout(tmp_path / "sub" / "rollout_7.pt", 7, samples, extra)
    assert path.is_file()
    assert [p.name for p in path.parent.iterdir()] == ["rollout_7.pt"]  # no temp file left behind
    rollout_id, loaded, loaded_extra = load_rollout(path)
    assert rollout_id == 7
    assert all(isinstance(s, Sample) and isinstance(s.trajectory, Trajectory) for s in loaded)
    assert all(isinstance(s.conditions, Conditions) for s in loaded)
    for original, back in zip(samples, loaded, strict=True):
        assert_same(original.to_dict(), back.to_dict(), "sample")
    assert_same(extra, loaded_extra, "extra")
    # the file is plain data: torch.load(weights_only=True) reads it directly
    raw = torch.load(path, weights_only=True)
    assert set(raw) == {"rollout_id", "samples", "extra"}


def test_round_trip_minimal_and_dict_rows(tmp_path: Path) -> None:
    plain = Sample(index=0, group_index=0, prompt="p")
    save_rollout(tmp_path / "r.pt", "eval_3", [plain, plain.to_dict()])
    rollout_id, loaded, extra = load_rollout(tmp_path / "r.pt")
    assert rollout_id == "eval_3" and extra is None and loaded == [plain, plain]


class Custom:
    pass


@pytest.mark.parametrize(
    ("mutate", "where", "what"),
    [
        (lambda s: s.metadata.__setitem__("foo", {1, 2}), r"samples\[1\]\.metadata\.foo", "builtins.set"),
        (lambda s: s.metadata.__setitem__("obj", [0, Custom()]), r"samples\[1\]\.metadata\.obj\[1\]", "Custom"),
        (lambda s: s.metadata.__setitem__("a b", object()), r"samples\[1\]\.metadata\['a b'\]", "builtins.object"),
        (lambda s: s.metadata.__setitem__("k", {3: "x"}), r"samples\[1\]\.metadata\.k: dict key 3", "str keys"),
        (lambda s: setattr(s, "image", torch.ones(2).numpy()), r"samples\[1\]\.image", "numpy.ndarray"),
        (
            lambda s: s.trajectory.sde_step_indices.append(Custom),
            r"samples\[1\]\.trajectory\.sde_step_indices\[2\]",
            "builtins.type",
        ),
    ],
)
def test_refuses_non_plain_objects(tmp_path: Path, mutate, where: str, what: str) -> None:
    samples = [make_sample(0), make_sample(1)]
    mutate(samples[1])
    with pytest.raises(ValueError, match=where) as info:
        save_rollout(tmp_path / "r.pt", 0, samples)
    assert what in str(info.value)
    assert not any(tmp_path.iterdir())  # nothing written, not even a temp file


def test_refuses_bad_extra_and_cycles(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^extra\.fn: cannot save"):
        save_rollout(tmp_path / "r.pt", 0, [], {"fn": print})
    loop: list = []
    loop.append(loop)
    with pytest.raises(ValueError, match="reference cycle"):
        check_serializable({"x": loop}, "extra")
    shared = torch.ones(2)
    check_serializable({"a": shared, "b": [shared, shared]})  # shared references are not cycles


def test_save_replaces_atomically(tmp_path: Path) -> None:
    path = tmp_path / "r.pt"
    save_rollout(path, 1, [make_sample(0)])
    save_rollout(path, 2, [make_sample(1), make_sample(2)])
    rollout_id, samples, _ = load_rollout(path)
    assert rollout_id == 2 and len(samples) == 2
    assert os.listdir(tmp_path) == ["r.pt"]


def test_load_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"rollout file not found: .*missing\.pt"):
        load_rollout(tmp_path / "missing.pt")
    (tmp_path / "garbage.pt").write_text("hello")
    with pytest.raises(ConfigError, match=r"garbage\.pt: not a rollout file"):
        load_rollout(tmp_path / "garbage.pt")
    torch.save({"weights": torch.ones(2)}, tmp_path / "other.pt")
    with pytest.raises(ConfigError, match=r"other\.pt: not a rollout file"):
        load_rollout(tmp_path / "other.pt")
    torch.save({"rollout_id": 0, "samples": [{"nope": 1}]}, tmp_path / "badrow.pt")
    with pytest.raises(ConfigError, match=r"badrow\.pt: samples\[0\] is not a sample"):
        load_rollout(tmp_path / "badrow.pt")


def test_load_refuses_forbidden_objects(tmp_path: Path) -> None:
    path = tmp_path / "evil.pt"
    torch.save({"rollout_id": 0, "samples": [], "extra": {"obj": Custom()}}, path)  # bypasses save_rollout
    with pytest.raises(ConfigError) as info:
        load_rollout(path)
    message = str(info.value)
    assert "\n" not in message
    assert str(path) in message and "may not contain" in message and "Custom" in message


def test_path_templates() -> None:
    assert format_rollout_path("out/rollout_{rollout_id}.pt", 3) == Path("out/rollout_3.pt")
    assert format_rollout_path("out/rollout_{}.pt", 3) == Path("out/rollout_3.pt")
    assert format_rollout_path("out/r_{rollout_id:04d}.pt", 3) == Path("out/r_0003.pt")
    assert format_rollout_path("fixed.pt", 9) == Path("fixed.pt")
    with pytest.raises(ConfigError, match="path template"):
        format_rollout_path("out/{step}.pt", 3)


def test_subsample() -> None:
    rows = list(range(10))
    assert subsample_rollout(rows, None) == rows
    assert subsample_rollout(rows, 1.0) == rows
    assert subsample_rollout(rows, 0.4) == [0, 1, 8, 9]
    assert subsample_rollout(rows, 0.5) == [0, 1, 7, 8, 9]  # int(5): first 5 // 2, last the rest
    assert subsample_rollout(rows, 0.4, group_size=2) == [0, 1, 8, 9]  # 2 of 5 whole groups
    assert subsample_rollout(rows, 0.6, group_size=2) == [0, 1, 6, 7, 8, 9]
    with pytest.raises(ConfigError, match="keeps none"):
        subsample_rollout(rows, 0.05)
    with pytest.raises(ConfigError, match=r"^--load-debug-rollout-data-subsample must be in \(0, 1\], got 1.5$"):
        subsample_rollout(rows, 1.5)


@pytest.mark.slow  # the session's tiny-sd3 build (a minute or two cold): not in the fast tier
def test_engine_samples_own_their_tensors(tiny_sd3_dir) -> None:
    """Each sample's latents and image have their own storage (not views of the microgroup's batch), so a
    rollout file or a Ray hand-off carries one sample's bytes per sample, not the batch's."""
    from miles.config.resolve import resolve
    from miles.rollout.engines.base import GenerateRequest
    from miles.rollout.engines.diffusers_engine import DiffusersEngine

    args = resolve(
        "rl",
        cli={
            "hf_checkpoint": str(tiny_sd3_dir),
            "prompt_data": "digits:train",
            "rm_type": "digit",
            "rollout_batch_size": 1,
            "n_samples_per_prompt": 4,
            "diffusion_num_sde_steps": 1,
            "actor_num_gpus_per_node": 1,
            "num_gpus_per_node": 1,
            "diffusion_height": 64,
            "diffusion_width": 64,
            "diffusion_debug_mode": True,
        },
    ).args
    engine = DiffusersEngine(args, device="cpu")
    request = GenerateRequest(
        prompt="a handwritten digit 3",
        metadata={},
        group_index=0,
        indices=[0, 1, 2, 3],
        seeds=[1, 2, 3, 4],
        sde_steps=[[0]] * 4,
        num_steps=2,
        guidance_scale=4.0,
        noise_level=0.7,
        sde_type="sde",
        height=64,
        width=64,
    )
    for sample in engine.generate([request]):
        for tensor in (sample.image, sample.trajectory.latents, sample.trajectory.debug_model_outputs):
            assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
