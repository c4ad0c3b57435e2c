"""`Packed`: a list of samples through pickle as a few stacked tensors, back as the same objects."""

from __future__ import annotations

import pickle

import torch

from miles.core.packed import Packed, pack
from miles.core.sample import Conditions, Sample, Trajectory


def _samples(groups: int = 3, per: int = 4) -> list[Sample]:
    out = []
    for g in range(groups):
        pos = {"prompt_embeds": torch.randn(5, 8), "pooled_prompt_embeds": torch.randn(8)}
        for j in range(per):
            trajectory = Trajectory(
                latents=torch.randn(4, 2, 3, 3),
                timesteps=torch.rand(3),
                sigmas=torch.rand(4),
                sde_step_indices=[0, 2],
                log_probs=torch.randn(2, dtype=torch.float64),
            )
            out.append(
                Sample(
                    index=g * per + j,
                    group_index=g,
                    prompt=f"p{g}",
                    metadata={"label": g},
                    seed=j,
                    trajectory=trajectory,
                    conditions=Conditions(pos, None, 4.0),
                    image=torch.rand(3, 4, 4).to(torch.bfloat16),
                )
            )
    return out


def test_round_trip_is_exact_and_keeps_sharing_dtypes_and_own_storage() -> None:
    samples = _samples()
    back = pickle.loads(pickle.dumps(Packed(samples)))
    assert isinstance(back, list) and len(back) == len(samples)
    for a, b in zip(samples, back, strict=True):
        assert (a.index, a.prompt, a.metadata, a.trajectory.sde_step_indices) == (
            b.index,
            b.prompt,
            b.metadata,
            b.trajectory.sde_step_indices,
        )
        for x, y in ((a.trajectory.latents, b.trajectory.latents), (a.image, b.image)):
            assert x.dtype == y.dtype and torch.equal(x, y)
        assert b.trajectory.log_probs.dtype == torch.float64
        # a tensor of its own: pickling one sample later does not carry its group's storage
        assert b.trajectory.latents.untyped_storage().nbytes() == b.trajectory.latents.numel() * 4
    # the conditions a request's samples share stay one object, one tensor
    assert back[0].conditions.positive is back[1].conditions.positive
    assert back[0].conditions.positive is not back[4].conditions.positive


def test_tensors_are_stacked_by_dtype_and_shape() -> None:
    samples = _samples(groups=2, per=3)
    _, groups, where = pack(samples)
    # latents, timesteps, sigmas, log_probs, image per sample; two condition tensors per group of samples
    assert len(where) == 6 * 5 + 2 * 2
    # each group travels as its bytes (a numpy uint8 array: pickle protocol 5 sends it out of band), dtype, shape
    assert sorted((dtype, shape) for _, dtype, shape in groups) == sorted(
        [
            ("float32", (6, 4, 2, 3, 3)),
            ("float32", (6, 3)),
            ("float32", (6, 4)),
            ("float64", (6, 2)),
            ("bfloat16", (6, 3, 4, 4)),
            ("float32", (2, 5, 8)),
            ("float32", (2, 8)),
        ]
    )
    assert all(data.dtype.name == "uint8" and data.ndim == 1 for data, _, _ in groups)


def test_groups_travel_out_of_band_and_read_only_buffers_unpack() -> None:
    """Protocol 5 with a buffer callback (what Ray does): the tensors' bytes leave as buffers, not in the pickle,
    and read-only buffers (Ray's object store) unpack into writable tensors of their own."""
    samples = _samples(groups=2, per=3)
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(Packed(samples), protocol=5, buffer_callback=buffers.append)
    payload = sum(t.numel() * t.element_size() for s in samples for t in (s.trajectory.latents, s.image))
    assert len(data) < payload and sum(b.raw().nbytes for b in buffers) > payload
    back = pickle.loads(data, buffers=[bytes(b.raw()) for b in buffers])  # bytes: read-only
    back[0].trajectory.latents.add_(1.0)  # its own, writable
    assert torch.equal(back[0].trajectory.latents, samples[0].trajectory.latents + 1.0)
    assert torch.equal(back[1].image, samples[1].image)


def test_what_it_cannot_pack_pickles_as_usual() -> None:
    param = torch.nn.Parameter(torch.ones(2))
    grad = torch.ones(2, requires_grad=True)
    back = pickle.loads(pickle.dumps(Packed({"p": param, "g": grad, "n": 3})))
    assert isinstance(back["p"], torch.nn.Parameter) and back["g"].requires_grad and back["n"] == 3
    local = pickle.loads(pickle.dumps(Packed([1, 2])))
    assert local == [1, 2]
