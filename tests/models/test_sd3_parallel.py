"""miles' SD3 joint-attention processor (`miles.models.sd3.parallel`) on one process: the attention backend
really changes the kernel and nothing else, and what the family interface refuses. (Sequence parallelism
across ranks: tests/training/test_parallel.py.)"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from miles.config.resolution import schema_args
from miles.core.errors import ConfigError
from miles.models.pipeline_config import TrainPipelineConfig
from miles.models.sd3.config import SD3TrainPipelineConfig
from miles.models.sd3.parallel import JointAttention, check_heads, check_tokens

FUSED = "aten::_scaled_dot_product_flash_attention_for_cpu"  # what SDPA picks on the CPU by default


def make_dit(sd35: bool) -> Any:
    """tiny-sd3's DiT shape, random weights; `sd35` adds SD3.5's dual attention and q/k RMS norms."""
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    extra: dict[str, Any] = {"dual_attention_layers": (0,), "qk_norm": "rms_norm"} if sd35 else {}
    return SD3Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=4,
        out_channels=4,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=4,
        joint_attention_dim=64,
        caption_projection_dim=64,
        pooled_projection_dim=64,
        pos_embed_max_size=16,
        **extra,
    )


class AttentionOps(TorchDispatchMode):
    """Records the aten attention and softmax kernels that run (below autograd: what SDPA really ran)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if "attention" in func.name() or "softmax" in func.name():
            self.seen.add(func.name())
        return func(*args, **(kwargs or {}))


def forward(model: Any) -> tuple[torch.Tensor, set[str]]:
    """The velocity of a fixed input, and the attention and softmax kernels that ran (forward and backward)."""
    g = torch.Generator().manual_seed(1)
    inputs = {
        "hidden_states": torch.randn(2, 4, 8, 8, generator=g),
        "encoder_hidden_states": torch.randn(2, 7, 64, generator=g),
        "pooled_projections": torch.randn(2, 64, generator=g),
        "timestep": torch.tensor([500.0, 20.0]),
    }
    with AttentionOps() as ops:
        out = model(**inputs, return_dict=False)[0]
        out.square().mean().backward()
    return out.detach(), ops.seen


def softmax(ops: set[str]) -> bool:
    return any("softmax" in op for op in ops)


@pytest.mark.parametrize("sd35", [False, True])
@pytest.mark.parametrize("backend", ["native", "_native_math"])
def test_backend_is_honoured_and_changes_only_the_kernel(sd35: bool, backend: str) -> None:
    reference, ref_ops = forward(make_dit(sd35))  # diffusers' JointAttnProcessor2_0
    model = make_dit(sd35)
    SD3TrainPipelineConfig().set_attention_backend(model, backend)
    processors = set(map(type, model.attn_processors.values()))
    assert processors == {JointAttention}
    assert {p.backend for p in model.attn_processors.values()} == {backend}
    out, ops = forward(model)
    assert (out - reference).abs().max().item() <= 1e-6
    assert FUSED in ref_ops and not softmax(ref_ops)
    # native: the same fused kernel; _native_math: SDPA's math path, decomposed into bmm + softmax
    assert (FUSED in ops, softmax(ops)) == ((True, False) if backend == "native" else (False, True))


def test_a_family_without_a_plan_refuses_sequence_parallelism() -> None:
    with pytest.raises(ConfigError) as err:
        TrainPipelineConfig().enable_sequence_parallel(torch.nn.Linear(1, 1), None)
    assert str(err.value) == (
        "--sequence-parallel-size: model family 'custom' has no sequence-parallel plan in miles; "
        "use --sequence-parallel-size 1"
    )


def test_heads_and_tokens_must_divide_by_the_sp_size() -> None:
    check_heads(4, 4)
    check_tokens((8, 8), 2, 4)  # 16 tokens
    with pytest.raises(ConfigError) as err:
        check_heads(24, 5)
    assert str(err.value) == "--sequence-parallel-size 5 (Ulysses degree 5) must divide the DiT's 24 attention heads"
    with pytest.raises(ConfigError) as err:
        check_tokens((6, 6), 2, 2)
    assert str(err.value) == (
        "--sequence-parallel-size 2 must divide the DiT's image tokens per sample: 9 here (3x3 patches of a 6x6 "
        "latent); change --diffusion-height/--diffusion-width or the sequence-parallel size"
    )


def test_the_trainer_refuses_a_cuda_backend_on_a_cpu_rank() -> None:
    from miles.training.model import parallelize_attention

    model = make_dit(False)
    args = schema_args(fsdp_attention_backend="flash")
    with pytest.raises(ConfigError, match="--fsdp-attention-backend flash needs CUDA, and this trainer rank has none"):
        parallelize_attention(model, args, SD3TrainPipelineConfig(), None)
    assert not any(isinstance(p, JointAttention) for p in model.attn_processors.values())  # nothing installed
