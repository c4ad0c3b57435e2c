"""Weight sync by handle (`miles.models.weight_ipc`): bucket planning, and a bucket's handles sent as plain
bytes to an unrelated process, which maps the sender's memory (no copy) and rebuilds every tensor."""

from __future__ import annotations

import gc
import hashlib
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from miles.models import weight_ipc

# the receiver: rebuild the bucket from stdin, print SHA-256 per tensor, write 7.0 into the first element, let go
RECEIVER = r"""
import hashlib, json, sys
import torch
from miles.models.weight_ipc import rebuild
tensors = rebuild(sys.stdin.buffer.read())
digests = {n: hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest() for n, t in tensors.items()}
print(json.dumps({"digests": digests, "shared": all(t.is_shared() for t in tensors.values())}))
next(iter(tensors.values())).view(-1)[0] = 7.0
del tensors  # let go, as a long-lived engine does once it has loaded a bucket
"""


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(16, 8, generator=g),
        "a.bias": torch.randn(16, generator=g),
        "b.weight": torch.randn(4, 4, generator=g).to(torch.bfloat16),
        "b.scaling": torch.tensor(2.0, dtype=torch.float64),
        "c.weight": torch.randn(32, 8, generator=g),
    }


def test_plan_groups_by_dtype_small_groups_first_and_cuts_at_the_buffer() -> None:
    state = _state()
    # fp32: a.weight 512 B, a.bias 64 B, c.weight 1024 B; bf16: 32 B; fp64: 8 B
    assert weight_ipc.plan(state, 600) == [["b.scaling"], ["b.weight"], ["a.weight", "a.bias"], ["c.weight"]]
    assert weight_ipc.plan(state, 10**9) == [["b.scaling"], ["b.weight"], ["a.weight", "a.bias", "c.weight"]]
    # a unit (one LoRA module's A and B) is never split; a tensor larger than the buffer travels alone
    assert weight_ipc.plan(state, 520, unit=lambda n: n.split(".")[0])[2:] == [["a.weight", "a.bias"], ["c.weight"]]


def test_a_bucket_holds_every_tensor_at_its_byte_offset() -> None:
    state = _state()
    buckets = weight_ipc.pack(state, 600)
    assert sum(b.nbytes for b in buckets) == sum(t.numel() * t.element_size() for t in state.values())
    for bucket in buckets:
        assert bucket.flat is not None and bucket.flat.dtype == torch.uint8 and bucket.flat.is_shared()
        for name, tensor in bucket.tensors().items():
            assert tensor.dtype == state[name].dtype and torch.equal(tensor, state[name])


@pytest.mark.slow  # over a second (a build, a video set, a spawned process)
def test_another_process_maps_the_bucket_from_plain_bytes_and_the_sender_frees_it(tmp_path: Path) -> None:
    state = _state()
    names = ["a.weight", "a.bias", "c.weight"]
    bucket = weight_ipc.pack_bucket(state, names)
    payload = weight_ipc.serialize(bucket)
    # a handle per bucket and metadata per tensor: a few hundred bytes, not the 1,600 of the weights
    assert len(payload) < 400 + 120 * len(names) < bucket.nbytes
    _, handle, _ = bucket.flat.untyped_storage()._share_filename_cpu_()  # the /dev/shm name the payload carries
    shm_file = Path("/dev/shm") / handle.decode().lstrip("/")
    assert shm_file.exists()

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run(
        [sys.executable, "-c", RECEIVER], input=payload, capture_output=True, check=True, env=env, timeout=120
    )
    result = json.loads(out.stdout.decode().strip().splitlines()[-1])
    assert result["digests"] == {n: _digest(state[n]) for n in names}  # every tensor, bit for bit
    assert result["shared"]
    assert bucket.tensors()["a.weight"][0, 0].item() == 7.0  # the receiver wrote into the sender's memory

    bucket.free()
    gc.collect()
    assert not shm_file.exists()  # the receiver has let go and the sender freed it: nothing left behind


def test_rebuild_refuses_a_payload_that_names_anything_but_tensor_handles() -> None:
    class Evil:
        def __reduce__(self):
            return (os.getcwd, ())

    with pytest.raises(pickle.UnpicklingError, match="may not name"):
        weight_ipc.rebuild(pickle.dumps({"transformer": {"flattened_tensor": Evil(), "metadata": []}}))
