"""The trained DiT's flags, on the functions that read them: which family is trained, gradient checkpointing,
and the FSDP2 wrapping (mixed-precision dtypes, CPU offload). Fast: a stand-in module, `fully_shard` recorded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from peft.tuners.lora import LoraLayer
from torch.distributed import fsdp

from miles.config.resolve import resolve
from miles.models.families import FAMILY_ENV
from miles.models.sd3.config import SD3TrainPipelineConfig
from miles.training.model import ModelBackend, apply_lora, family_of, load_transformer, shard


class MyFamily(SD3TrainPipelineConfig):
    name = "my-family"


class Block(torch.nn.Linear):
    def __init__(self) -> None:
        super().__init__(2, 2)
        self.checkpointing = False

    def enable_gradient_checkpointing(self) -> None:
        self.checkpointing = True


class TinyDiT(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.transformer_blocks = torch.nn.ModuleList([Block(), Block()])
        self.checkpointing = False

    def enable_gradient_checkpointing(self) -> None:
        self.checkpointing = True


class TinyBackend(ModelBackend):
    def load_denoiser(self, checkpoint_dir: str, dtype: torch.dtype, components: tuple[str, ...]) -> torch.nn.Module:
        return TinyDiT().to(dtype)


@pytest.fixture(scope="module")
def base_args() -> Any:
    return resolve("rl", recipe="tiny-digits-grpo").args


def test_family_flags_choose_the_trained_family(base_args: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FAMILY_ENV, raising=False)
    assert family_of(base_args).name == "sd3"  # from the checkpoint name
    flux = base_args.with_values({"diffusion_model_family": "flux"}, "cli")
    assert family_of(flux).name == "flux"
    mine = base_args.with_values({"train_pipeline_config_path": f"{__name__}.MyFamily"}, "cli")
    assert type(family_of(mine)) is MyFamily


@pytest.mark.parametrize("on", [True, False])
def test_gradient_checkpointing_turns_on_the_models_checkpointing(base_args: Any, tmp_path: Path, on: bool) -> None:
    args = base_args.with_values(
        {"model_backend_path": f"{__name__}.TinyBackend", "gradient_checkpointing": on}, "cli"
    )
    model = load_transformer(args, SD3TrainPipelineConfig(), checkpoint=tmp_path)
    assert isinstance(model, TinyDiT) and model.checkpointing is on


@pytest.fixture
def sharded(monkeypatch: pytest.MonkeyPatch) -> list[tuple[torch.nn.Module, dict[str, Any]]]:
    calls: list[tuple[torch.nn.Module, dict[str, Any]]] = []
    monkeypatch.setattr(fsdp, "fully_shard", lambda module, **kwargs: calls.append((module, kwargs)) or module)
    return calls


@pytest.mark.parametrize(
    ("forward", "master", "reduce", "param_dtype"),
    [
        ("bf16", "fp32", "fp32", torch.bfloat16),  # the default: bf16 compute over fp32 masters
        ("fp32", "fp32", "bf16", None),  # compute in the master dtype: no cast; a bf16 reduce-scatter
        ("fp16", "bf16", "fp32", torch.float16),
    ],
)
def test_dtype_flags_make_the_fsdp_mixed_precision_policy(
    base_args: Any, sharded: list, forward: str, master: str, reduce: str, param_dtype: torch.dtype | None
) -> None:
    args = base_args.with_values(
        {"diffusion_forward_dtype": forward, "fsdp_master_dtype": master, "fsdp_reduce_dtype": reduce}, "cli"
    )
    model = TinyDiT()
    shard(model, args)
    assert sharded[-1][0] is model  # the root last (every block before it over several ranks)
    for _, kwargs in sharded:
        policy = kwargs["mp_policy"]
        assert policy.param_dtype == param_dtype
        assert policy.reduce_dtype == {"fp32": torch.float32, "bf16": torch.bfloat16}[reduce]
        assert policy.cast_forward_inputs is (param_dtype is not None)
        assert "offload_policy" not in kwargs  # --fsdp-cpu-offload is off


def test_one_rank_wraps_the_root_alone_unless_it_offloads(base_args: Any, sharded: list) -> None:
    """World 1: one FSDP unit (the root), nothing to shard or stream per block; --fsdp-cpu-offload keeps the
    per-block units (each block's parameters come in from host memory on their own)."""
    import torch.distributed as dist

    created = not dist.is_initialized()  # an in-process trainer of an earlier test may have made one
    if created:
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        assert dist.get_world_size() == 1
        model = TinyDiT()
        shard(model, base_args)
        assert [module for module, _ in sharded] == [model]
        sharded.clear()
        offloaded = TinyDiT()
        shard(offloaded, base_args.with_values({"fsdp_cpu_offload": True}, "cli"))
        assert [module for module, _ in sharded] == [*offloaded.transformer_blocks, offloaded]
    finally:
        if created:
            dist.destroy_process_group()


def test_fsdp_cpu_offload_shards_with_the_cpu_offload_policy(base_args: Any, sharded: list) -> None:
    shard(TinyDiT(), base_args.with_values({"fsdp_cpu_offload": True}, "cli"))
    policies = [kwargs["offload_policy"] for _, kwargs in sharded]
    assert len(policies) == 3 and all(isinstance(p, fsdp.CPUOffloadPolicy) for p in policies)
    assert all(p.pin_memory is torch.cuda.is_available() for p in policies)  # nothing to pin on a CPU-only rank


class Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.to_q, self.to_k, self.to_out = (torch.nn.Linear(64, 64) for _ in range(3))


@pytest.mark.parametrize("init", ["kaiming-uniform", "gaussian"])
def test_lora_flags_shape_the_adapter(base_args: Any, init: str) -> None:
    flags = {"use_lora": True, "lora_rank": 4, "lora_alpha": 8, "lora_target_modules": ["to_q", "to_k"]}
    args = base_args.with_values({**flags, "lora_init_weights": init}, "cli")
    torch.manual_seed(0)
    model = apply_lora(torch.nn.ModuleDict({"attn": Attention()}), args, SD3TrainPipelineConfig())
    layers = {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}
    assert sorted(layers) == ["attn.to_k", "attn.to_q"]  # --lora-target-modules, not the family's list
    for layer in layers.values():
        assert layer.r["default"] == 4 and layer.scaling["default"] == 8 / 4  # alpha / rank
        assert layer.lora_A["default"].weight.shape == (4, 64)
        assert not layer.lora_B["default"].weight.any()  # the adapter starts as the identity
        # kaiming-uniform A is bounded by 1/sqrt(64); gaussian A has std 1/rank, so it reaches past that
        assert (layer.lora_A["default"].weight.abs().max().item() > 0.125) is (init == "gaussian")
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
