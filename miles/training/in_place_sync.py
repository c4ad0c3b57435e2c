"""In-place weight sync under `--colocate`: a trainer rank hands its engine the weights by handle.

Engine i sits on the devices of trainer ranks [i*g, (i+1)*g) (g = `--rollout-num-gpus-per-engine`), and
rank i*g, the first of them, feeds it. Every rank joins the gather (`Trainer.weights_for_sync`: full
weights, LoRA merged, or only the LoRA tensors under `--lora-ipc-weight-sync`); each feeding rank then,
bucket by bucket (`miles.models.weight_ipc`: per dtype, at most `--update-weight-buffer-size` bytes),
packs the bucket on its device, calls its engine actor with the serialized handles, waits until the
engine has loaded them and frees the bucket. Only the handles travel through Ray (a few hundred bytes
per bucket); the weights themselves are read by the engine from the trainer's memory: shared memory on
CPU, CUDA IPC on a GPU.

Engines:
  diffusers  `update_weights_from_ipc(payload, version)`: rebuild, load, merge LoRA entries
  sglang     `/update_weights_from_tensor` (`load_format="flattened_bucket"`; LoRA-only payloads as
             `weight_update_mode="lora_merge"` with one `lora_alpha`), then every transformer parameter
             checked against the digests computed here (`/update_weights_from_tensor_checker`), as the
             disk path checks them
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from miles.models import weight_ipc
from miles.models.lora_sync import is_lora_entry


def source_engine(args: Any, rank: int, num_engines: int) -> int | None:
    """The engine rank `rank` feeds, or None (it only joins the gather)."""
    per_engine = max(1, int(args.rollout_num_gpus_per_engine or 1))
    if rank % per_engine or rank // per_engine >= num_engines:
        return None
    return rank // per_engine


def _lora_unit(name: str) -> str:
    """A LoRA module's tensors share a bucket (sglang's `lora_merge` pairs A with B within one request)."""
    return name.rpartition(".")[0] if is_lora_entry(name) else name


def _sync_device() -> torch.device:
    """Buckets live where the engine can map them: this rank's GPU (CUDA IPC), else shared CPU memory."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def push_buckets(
    state: dict[str, torch.Tensor],
    buffer_bytes: int,
    send: Callable[[Any], object],
    serialize: Callable[[weight_ipc.Bucket], bytes | str] = weight_ipc.serialize,
) -> weight_ipc.IpcStats:
    """Pack `state` bucket by bucket, `send(serialized)` each (it returns once the engine has loaded it),
    and free the bucket; the stats of what went by handle."""
    stats = weight_ipc.IpcStats()
    device = _sync_device()
    for names in weight_ipc.plan(state, buffer_bytes, _lora_unit):
        bucket = weight_ipc.pack_bucket(state, names, device)
        payload = serialize(bucket)
        send(payload)
        stats.add(bucket, len(payload))
        bucket.free()
    if device.type == "cuda":
        torch.cuda.ipc_collect()  # release the sent blocks the engine has let go of
    return stats


class SglangExpectations:
    """What an sglang engine must hold after a sync, as the disk path computes it: SHA-256 per transformer
    parameter. A LoRA adapter merges onto the checkpoint's weights (the base of every sync of a LoRA run)."""

    def __init__(self, args: Any) -> None:
        from miles.core.inputs import input_path
        from miles.rollout.engines.sglang.sync import transformer_layout
        from miles.training.model import DTYPES, family_of

        self.family = family_of(args)  # sglang's port may hold some tensors fused (qwen_image's text q/k/v)
        checkpoint = input_path(args, args.hf_checkpoint)
        self.family.bind_checkpoint(checkpoint)  # the layout may depend on the checkpoint (cosmos3's MLP kind)
        self.params, self.linears = transformer_layout(checkpoint)
        self.dtype = DTYPES[args.diffusion_forward_dtype]
        self.base_files = sorted((checkpoint / "transformer").glob("*.safetensors"))
        self._base_sha: dict[str, str] | None = None

    def full(self, state: dict[str, torch.Tensor]) -> dict[str, str]:
        from miles.rollout.engines.sglang.sync import engine_sha256

        return engine_sha256({k: v for k, v in state.items() if k in self.params}, self.dtype, self.family)

    def lora(self, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], alpha: int) -> dict[str, str]:
        from miles.rollout.engines.sglang.sync import lora_merged_sha256

        if self._base_sha is None:
            self._base_sha = self._checkpoint_sha()
        return lora_merged_sha256(
            self.base_files, self._base_sha, pairs, alpha, self.linears, self.dtype, family=self.family
        )

    def _checkpoint_sha(self) -> dict[str, str]:
        from miles.rollout.engines.sglang.sync import files_engine_sha256

        return files_engine_sha256(self.base_files, self.params, self.dtype, self.family)


def push_to_diffusers(engine: Any, state: dict[str, torch.Tensor], args: Any, version: int) -> dict[str, float]:
    import ray

    def send(payload: bytes) -> None:
        ray.get(engine.update_weights_from_ipc.remote(payload, version))

    start = time.perf_counter()
    stats = push_buckets(state, int(args.update_weight_buffer_size), send)
    return _metrics(stats, time.perf_counter() - start)


def push_to_sglang(
    engine: Any, state: dict[str, torch.Tensor], args: Any, expectations: SglangExpectations
) -> dict[str, float]:
    """Load by handle, then verify every parameter; LoRA-only payloads go as sglang's `lora_merge`."""
    import ray

    from miles.rollout.engines.sglang.sync import cast_kept_modules, lora_adapter_pairs

    start = time.perf_counter()
    lora_alpha: int | None = None
    if state and all(is_lora_entry(name) for name in state):
        pairs, lora_alpha = lora_adapter_pairs(state)
        sent = {f"{m}.{part}": t for m, ab in pairs.items() for part, t in zip(("lora_A", "lora_B"), ab, strict=True)}
    else:  # the modules sglang keeps in fp32 get the DiT precision's values, as from a written shard
        sent = cast_kept_modules(state, expectations.dtype, expectations.family)

    def send(payload: str) -> None:
        ray.get(engine.update_weights_from_ipc.remote(payload, lora_alpha))

    stats = push_buckets(sent, int(args.update_weight_buffer_size), send, serialize=weight_ipc.serialize_b64)
    loaded = time.perf_counter()
    expected = expectations.lora(pairs, lora_alpha) if lora_alpha is not None else expectations.full(state)
    ray.get(engine.verify_weights.remote(expected))
    metrics = _metrics(stats, loaded - start)
    metrics["sync/verified_tensors"] = float(len(expected))
    metrics["sync/verify_time"] = time.perf_counter() - loaded
    return metrics


def _metrics(stats: weight_ipc.IpcStats, seconds: float) -> dict[str, float]:
    return {
        "sync/tensors": float(stats.tensors),
        "sync/buckets": float(stats.buckets),
        "sync/bytes_by_handle": float(stats.bytes_by_handle),
        "sync/bytes_serialized": float(stats.bytes_serialized),
        "sync/push_time": seconds,
    }


class InPlaceSync:
    """One trainer rank's side of the in-place sync (kept by the rank: sglang's base digests are cached)."""

    def __init__(self, args: Any, rank: int) -> None:
        self.args, self.rank = args, rank
        self._expectations: SglangExpectations | None = None

    def __call__(self, state: dict[str, torch.Tensor], engines: list[Any], version: int) -> dict[str, float]:
        """Push `state` (this rank's result of the gather) to the engine this rank feeds; what it pushed
        (empty for a rank that feeds no engine)."""
        index = source_engine(self.args, self.rank, len(engines))
        if index is None:
            return {}
        if self.args.rollout_backend == "sglang":
            if self._expectations is None:
                self._expectations = SglangExpectations(self.args)
            return push_to_sglang(engines[index], state, self.args, self._expectations)
        return push_to_diffusers(engines[index], state, self.args, version)
