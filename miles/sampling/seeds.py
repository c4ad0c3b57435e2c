"""The rollout seed layout and the initial noise drawn from it.

Layout (miles_docs.md §4.1 "Seed layout")::

    seed_base       = (rollout_seed + group_index * n_samples_per_prompt) % 2**31
    microgroup_seed = seed_base + offset      # offset: the microgroup's first sample within its group
    sample seeds    = microgroup_seed .. microgroup_seed + M - 1   (the engine's expansion, M = microgroup size)

So the j-th sample of group g always has seed `seed_base(g) + j`, however the group is split into
microgroups. `group_index` is monotonic over the whole run (it does not restart each rollout), so
groups occupy disjoint seed ranges and every (rollout, group, sample) has its own seed, reproducible
from `--rollout-seed` alone (until the 2**31 wrap of `seed_base`, i.e. for 2**31 / n samples).
Per-sample seeds are not reduced modulo 2**31 (the docs add the offset after the modulo); every
generator used here takes 64-bit seeds.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

SEED_MODULUS = 2**31


def seed_base(rollout_seed: int, group_index: int, n_samples_per_prompt: int) -> int:
    """The first seed of prompt group `group_index`."""
    if n_samples_per_prompt < 1:
        raise ValueError(f"n_samples_per_prompt must be >= 1, got {n_samples_per_prompt}")
    if group_index < 0:
        raise ValueError(f"group_index must be >= 0, got {group_index}")
    return (rollout_seed + group_index * n_samples_per_prompt) % SEED_MODULUS


def microgroup_seed(rollout_seed: int, group_index: int, n_samples_per_prompt: int, offset: int) -> int:
    """The request seed of the microgroup whose first sample is sample `offset` of its group."""
    if not 0 <= offset < n_samples_per_prompt:
        raise ValueError(f"offset {offset} outside the group [0, {n_samples_per_prompt})")
    return seed_base(rollout_seed, group_index, n_samples_per_prompt) + offset


def expand_seed(seed: int, count: int) -> list[int]:
    """The engine's expansion of one request seed into per-sample seeds `seed .. seed + count - 1`."""
    return list(range(seed, seed + count))


def group_sample_seeds(
    rollout_seed: int, group_index: int, n_samples_per_prompt: int, microgroup_size: int | None = None
) -> list[int]:
    """Per-sample seeds of one group, built microgroup by microgroup (size M; default: the whole group).

    The result is `seed_base .. seed_base + n - 1` for any M; the last microgroup may be smaller.
    """
    m = microgroup_size or n_samples_per_prompt
    if m < 1:
        raise ValueError(f"microgroup_size must be >= 1, got {m}")
    seeds: list[int] = []
    for offset in range(0, n_samples_per_prompt, m):
        count = min(m, n_samples_per_prompt - offset)
        seeds += expand_seed(microgroup_seed(rollout_seed, group_index, n_samples_per_prompt, offset), count)
    return seeds


def cpu_generator(seed: int) -> torch.Generator:
    """`torch.Generator("cpu").manual_seed(seed)`."""
    return torch.Generator("cpu").manual_seed(int(seed))


def noise_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A sample's generator on `device` (`--diffusion-generator-device`), seeded with `seed`. A CUDA
    generator draws other numbers than a CPU one with the same seed (as in diffusers and sglang)."""
    return torch.Generator(torch.device(device)).manual_seed(int(seed))


def draw_normal(shape: Sequence[int], generator: torch.Generator) -> torch.Tensor:
    """fp32 standard normal noise of `shape` drawn on the generator's device, returned on the CPU."""
    return torch.randn(tuple(shape), generator=generator, dtype=torch.float32, device=generator.device).cpu()


def generator_device(name: str, engine_device: torch.device | str) -> torch.device:
    """The device of an engine's noise generators for `--diffusion-generator-device` `name`: `cpu`, `cuda`
    (the engine's own GPU when it runs on one, else the current CUDA device) or `cuda:N`. An engine process
    without CUDA cannot hold a CUDA generator: that is an error naming the flag (the config rules refuse an
    explicit `cuda` on a machine without GPUs and resolve the default to `cpu` there)."""
    device = torch.device(name)
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise ValueError(f"--diffusion-generator-device {name}: expected cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"--diffusion-generator-device {name}: this engine process sees no CUDA device; "
            "use --diffusion-generator-device cpu"
        )
    engine = torch.device(engine_device)
    if device.index is None:
        return engine if engine.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
    return device


def initial_noise(
    seed: int,
    shape: Sequence[int],
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The start latent of the sample with `seed`: standard normal noise of `shape`.

    Identical to `torch.randn(shape, generator=torch.Generator("cpu").manual_seed(seed), dtype=dtype)`
    moved to `device`, which is also what diffusers' `randn_tensor` draws for a pipeline called with
    `generator=torch.Generator("cpu").manual_seed(seed)`. So the engine and a plain-diffusers baseline
    start from the same latent, whatever device either runs on. (A leading batch dim of 1 draws the
    same values: `[1, C, h, w]` and `[C, h, w]` agree.)
    """
    return torch.randn(tuple(shape), generator=cpu_generator(seed), dtype=dtype).to(device)


def initial_noise_batch(
    seeds: Sequence[int],
    shape: Sequence[int],
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """`[len(seeds), *shape]`: one `initial_noise` per seed, stacked (a sample's noise ignores its batch)."""
    return torch.stack([initial_noise(s, shape, dtype) for s in seeds]).to(device)
