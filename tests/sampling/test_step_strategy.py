"""Step strategies and the --diffusion-step-strategy-path hook (algorithms.md D.7.2)."""

from __future__ import annotations

import numpy as np
import pytest

from miles.config.resolution import schema_args
from miles.core.errors import ConfigError
from miles.core.sample import Sample
from miles.sampling import step_strategies as hub
from miles.sampling.seeds import group_sample_seeds


def _args(**kw):
    base = dict(
        rollout_batch_size=4,
    )
    base.update(kw)
    return schema_args(**base)


def _sample(group_index=0, index=0):
    return Sample(index=index, group_index=group_index, prompt="p")


def custom_strategy(args, sample, num_steps, seed):  # loaded by dotted path below
    return [num_steps - 1, 0, 0], None


def test_sde_window_fast_recipe():
    args = _args(diffusion_num_sde_steps=3, diffusion_sde_window_range=(0, 5))
    starts = set()
    for seed in range(200):
        steps, ret = hub.sde_window(args, _sample(), 10, seed)
        assert len(steps) == 3 and steps == list(range(steps[0], steps[0] + 3))
        assert ret == list(range(steps[0], steps[0] + 4))  # W + 1 latents
        starts.add(steps[0])
        assert hub.sde_window(args, _sample(), 10, seed) == (steps, ret)  # reproducible per seed
    assert starts == {0, 1, 2}
    # the documented RNG
    assert hub.sde_window(args, _sample(), 10, 5)[0][0] == int(np.random.default_rng(5).integers(0, 3))


def test_sde_window_range_forms_and_errors():
    full = _args(diffusion_num_sde_steps=10)
    assert hub.sde_window(full, _sample(), 10, 0)[0] == list(range(10))
    from_string = _args(diffusion_num_sde_steps=2, diffusion_sde_window_range="3,5")
    assert hub.sde_window(from_string, _sample(), 10, 1)[0] == [3, 4]
    with pytest.raises(ValueError, match="num-sde-steps"):
        hub.sde_window(_args(), _sample(), 10, 0)
    with pytest.raises(ValueError, match="does not fit"):
        hub.sde_window(_args(diffusion_num_sde_steps=3, diffusion_sde_window_range=(3, 5)), _sample(), 10, 0)
    with pytest.raises(ValueError, match="window-range"):
        hub.sde_window(_args(diffusion_num_sde_steps=1, diffusion_sde_window_range=(4, 12)), _sample(), 10, 0)


def test_epoch_global_random_choice():
    args = _args(diffusion_num_sde_steps=2, diffusion_sde_candidate_steps=[8, 9, 10, 11], rollout_batch_size=4)
    seeds = group_sample_seeds(42, 0, 16)
    per_epoch = []
    for epoch in range(6):
        picks = {
            tuple(hub.epoch_global_random_choice(args, _sample(group_index=epoch * 4 + g), 12, seed)[0])
            for g in range(4)
            for seed in seeds
        }
        assert len(picks) == 1  # shared by every sample of the epoch, whatever its seed
        (pick,) = picks
        assert len(pick) == 2 and list(pick) == sorted(pick) and set(pick) <= {8, 9, 10, 11}
        per_epoch.append(pick)
    assert len(set(per_epoch)) > 1  # changes across epochs
    steps, ret = hub.epoch_global_random_choice(args, _sample(), 12, 0)
    assert ret == hub.return_indices(steps)
    # k >= len(candidates) (or k == 0): all of them
    every = _args(diffusion_num_sde_steps=5, diffusion_sde_candidate_steps=[3, 1, 2])
    assert hub.epoch_global_random_choice(every, _sample(), 10, 0)[0] == [1, 2, 3]
    with pytest.raises(ValueError, match="--diffusion-sde-candidate-steps"):
        hub.epoch_global_random_choice(_args(diffusion_num_sde_steps=2), _sample(), 10, 0)
    with pytest.raises(ValueError, match="outside"):
        hub.epoch_global_random_choice(_args(diffusion_sde_candidate_steps=[9, 10]), _sample(), 10, 0)


def test_default_steps():
    window = _args(diffusion_num_sde_steps=2)
    steps, ret = hub.default_steps(window, _sample(), 10, 3)
    assert steps == hub.sde_window(window, _sample(), 10, 3)[0] and len(ret) == 3
    assert hub.default_steps(_args(), _sample(), 10, 0) == (list(range(9)), list(range(10)))
    assert hub.default_steps(_args(diffusion_sde_type="cps"), _sample(), 10, 0)[0] == list(range(9))
    assert hub.default_steps(_args(diffusion_sde_type="ode"), _sample(), 10, 0) == ([], None)
    assert hub.default_steps(_args(diffusion_noise_level=0.0), _sample(), 10, 0) == ([], None)
    assert hub.ode_and_return_last(_args(), _sample(), 10, 0) == (None, [10])


def test_resolve_and_select():
    assert hub.resolve_step_strategy(_args()) is hub.default_steps
    assert hub.resolve_step_strategy(_args(diffusion_step_strategy_path="sde_window")) is hub.sde_window
    path = "miles.sampling.step_strategies.epoch_global_random_choice"
    assert hub.resolve_step_strategy(_args(diffusion_step_strategy_path=path)) is hub.epoch_global_random_choice
    custom = _args(diffusion_step_strategy_path=f"{__name__}.custom_strategy")
    assert hub.resolve_step_strategy(custom) is custom_strategy
    assert hub.select_steps(custom, _sample(), 10, 0) == ([0, 9], None)
    ode = _args(diffusion_step_strategy_path="ode_and_return_last")
    assert hub.select_steps(ode, _sample(), 10, 0) == ([], [10])
    for bad in ("no_such_module_xyz.fn", f"{__name__}.missing_fn", "nodots"):
        with pytest.raises(ConfigError, match="--diffusion-step-strategy-path"):
            hub.resolve_step_strategy(_args(diffusion_step_strategy_path=bad))
    with pytest.raises(ValueError, match="outside"):
        hub.select_steps(_args(), _sample(), 10, 0, strategy=lambda *a: ([10], None))
    with pytest.raises(TypeError, match="must return"):
        hub.select_steps(_args(), _sample(), 10, 0, strategy=lambda *a: [1])
