"""What an in-process engine actor reports and hands over for fault tolerance (`--use-fault-tolerance`).

status()           pid and weight version, answered on the actor's "health" thread while it generates
weights_digest()   SHA-256 over the denoiser's parameters and buffers (name, dtype, shape, bytes) and
                   the weight version: a restarted engine must report what its predecessor did
export_weights()   the denoiser's weights with the LoRA base copies, for a restarted sibling after an
import_weights()   in-place sync (--colocate), whose tensors the manager never held
simulate_crash()   the CI fault injection (--ci-test): the process exits at once, mid-request
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import torch

HEALTH_GROUP = "health"  # the actor's concurrency group for status / crash calls (answered while it generates)


def state_digest(state: dict[str, torch.Tensor]) -> str:
    """SHA-256 over a state dict in name order: each name and its tensor's digest (`tensor_sha256`, the one
    the sglang weight checker uses: dtype, shape, bytes)."""
    from miles.rollout.engines.sglang.sync import tensor_sha256

    digest = hashlib.sha256()
    for name in sorted(state):
        digest.update(f"{name}|{tensor_sha256(state[name])}|".encode())
    return digest.hexdigest()


class RecoverableEngine:
    """Mixed into the engine actor (`DiffusersEngine`: `transformer`, `weight_version`, `lora_merger`)."""

    transformer: torch.nn.Module
    weight_version: int
    lora_merger: Any

    def status(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "weight_version": int(self.weight_version)}

    def weights_digest(self) -> dict[str, Any]:
        state = self.transformer.state_dict()
        return {"sha256": state_digest(state), "version": int(self.weight_version), "tensors": len(state)}

    def export_weights(self) -> dict[str, Any]:
        own = self.transformer.state_dict()
        return {
            "state": {k: v.detach().cpu().clone() for k, v in own.items()},
            "lora_base": {k: v.detach().cpu().clone() for k, v in self.lora_merger.base.items()},
            "version": int(self.weight_version),
        }

    def import_weights(self, payload: dict[str, Any]) -> int:
        own = self.transformer.state_dict()
        with torch.no_grad():
            for name, tensor in payload["state"].items():
                own[name].copy_(tensor.to(own[name].device, own[name].dtype))
        self.lora_merger.restore(self.transformer, payload["lora_base"])  # in host memory, as the merger keeps them
        self.weight_version = int(payload["version"])
        return len(payload["state"])

    def simulate_crash(self) -> None:
        os._exit(1)
