"""The engine's DMD2 few-step rollouts on tiny-sd3: stop-at-step call counts and timesteps, the stored
trajectory layout, and agreement between the stopped (training) and full (eval) paths."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miles.config.resolve import resolve
from miles.rollout.dmd2.engine import few_step_request
from miles.rollout.engines.diffusers_engine import DiffusersEngine
from miles.sampling.seeds import cpu_generator

pytestmark = pytest.mark.slow

STEPS = [999, 749, 499, 249]
SEEDS = [21, 22, 23]


@pytest.fixture(scope="module")
def engine(tiny_sd3_dir: Path) -> DiffusersEngine:
    args = resolve("dmd2", recipe="tiny-digits-4step", cli={"hf_checkpoint": str(tiny_sd3_dir)}).args
    return DiffusersEngine(args, device="cpu")


@pytest.fixture
def calls(engine: DiffusersEngine):
    """The timestep and batch size of every transformer call."""
    seen: list[tuple[float, int]] = []

    def hook(module, args, kwargs):
        t = kwargs["timestep"]
        seen.append((float(t[0]), int(t.shape[0])))

    handle = engine.transformer.register_forward_pre_hook(hook, with_kwargs=True)
    yield seen
    handle.remove()


def _requests(stop_at: int | None, negative: bool = True):
    return [
        few_step_request(
            f"a handwritten digit {d}",
            {"label": d},
            g,
            [g],
            [seed],
            timesteps=STEPS,
            stop_at=stop_at,
            negative=negative,
            height=64,
            width=64,
        )
        for g, (d, seed) in enumerate(zip([3, 5, 3], SEEDS, strict=True))
    ]


@pytest.mark.parametrize("k", [0, 2, 3])
def test_a_stopped_rollout_calls_the_student_k_plus_one_times_in_one_batch(engine, calls, k: int) -> None:
    samples = engine.generate_few_step(_requests(k))
    # k simulated steps at t_0..t_{k-1}, then the student's x0 at t_k: one batched call each, no CFG
    assert calls == [(float(t), len(SEEDS)) for t in STEPS[: k + 1]]
    for sample, seed in zip(samples, SEEDS, strict=True):
        traj = sample.trajectory
        assert traj.latents.shape == (k + 2, 4, 8, 8) and traj.timesteps.tolist() == STEPS[: k + 1]
        assert traj.sigmas.tolist() == pytest.approx([t / 1000 for t in STEPS[: k + 1]] + [0.0])
        noise = torch.randn((4, 8, 8), generator=cpu_generator(seed))
        assert torch.equal(traj.latents[0], noise)  # x_{t_0} is the seed's pure noise
        assert sample.image is None and sample.conditions.negative is not None  # the teacher's CFG needs it
        assert sample.conditions.guidance_scale == 1.0


def test_the_eval_path_equals_the_stopped_path_run_to_the_end(engine, calls) -> None:
    stopped = engine.generate_few_step(_requests(len(STEPS) - 1, negative=False))
    calls.clear()
    full = engine.generate_few_step(_requests(None, negative=False))
    assert [t for t, _ in calls] == [float(t) for t in STEPS]  # n calls
    x0 = torch.stack([s.trajectory.latents[-1] for s in stopped])
    images = engine.family.decode_latents(engine.pipe, x0).float()
    for sample, image in zip(full, images, strict=True):
        assert sample.trajectory is None and sample.conditions is None
        assert torch.allclose(sample.image, image, atol=1e-5)
    assert not torch.allclose(full[0].image, full[2].image)  # same prompt, different seeds


def test_one_call_takes_one_stop_step(engine) -> None:
    with pytest.raises(ValueError, match="one stop step"):
        engine.generate_few_step(_requests(0)[:1] + _requests(1)[1:])
