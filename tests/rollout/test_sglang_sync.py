"""Weight sync to sglang engines, no server: the checker's digests, the files written for
`/update_weights_from_disk` and `/v1/set_lora`, and what the engine must hold after a LoRA merge.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from miles.rollout.engines.sglang.sync import (
    KEEP_VERSIONS,
    WEIGHTS_FILE,
    expected_sha256,
    lora_wrapped_names,
    tensor_sha256,
    transformer_layout,
    write_lora_adapter,
    write_transformer,
)

# ---------------------------------------------------------------------------- sync: digests


def reference_sha256(t: torch.Tensor) -> str:
    hasher = hashlib.sha256()
    hasher.update(str(t.dtype).encode())
    hasher.update(repr(tuple(t.shape)).encode())
    hasher.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_tensor_sha256_is_dtype_shape_and_bytes(dtype: torch.dtype) -> None:
    t = torch.randn(3, 5, generator=torch.Generator().manual_seed(0)).to(dtype)
    digest = tensor_sha256(t)
    assert digest == reference_sha256(t)
    assert len(digest) == 64
    # a transposed (non-contiguous) view hashes its values in logical order
    assert tensor_sha256(t.t()) == reference_sha256(t.t().contiguous())


def test_tensor_sha256_sees_one_ulp_dtype_and_shape() -> None:
    t = torch.tensor([1.0, 2.0, 3.0, 4.0])
    bumped = t.clone()
    bumped[2] = torch.nextafter(bumped[2], torch.tensor(10.0))
    assert bumped[2].item() != 3.0
    digests = {
        tensor_sha256(t),
        tensor_sha256(bumped),
        tensor_sha256(t.view(torch.int32)),  # same bytes, other dtype
        tensor_sha256(t.view(2, 2)),  # same bytes, other shape
    }
    assert len(digests) == 4


def test_expected_sha256_casts_to_the_engine_dtype() -> None:
    state = {"a.weight": torch.randn(4, 4), "a.bias": torch.randn(4)}
    expected = expected_sha256(state, torch.bfloat16)
    assert expected == {name: reference_sha256(t.to(torch.bfloat16)) for name, t in state.items()}
    assert expected["a.weight"] != tensor_sha256(state["a.weight"])


def test_lora_wrapped_names() -> None:
    names = [
        "blocks.0.attn.to_q.weight",
        "blocks.0.attn.to_q.bias",
        "blocks.0.ff.net.2.weight",  # a linear without bias
        "pos_embed.proj.weight",  # conv
        "pos_embed.proj.bias",
        "blocks.0.norm.weight",  # norm
        "blocks.0.norm.bias",
        "norm_out.linear.weight",
        "norm_out.linear.bias",
        "blocks.0.attn.to_q_extra.weight",  # a name that only starts like a linear's
    ]
    linears = frozenset({"blocks.0.attn.to_q", "blocks.0.ff.net.2", "norm_out.linear"})
    assert lora_wrapped_names(names, linears) == {
        "blocks.0.attn.to_q.weight": "blocks.0.attn.to_q.base_layer.weight",
        "blocks.0.attn.to_q.bias": "blocks.0.attn.to_q.base_layer.bias",
        "blocks.0.ff.net.2.weight": "blocks.0.ff.net.2.base_layer.weight",
        "pos_embed.proj.weight": "pos_embed.proj.weight",
        "pos_embed.proj.bias": "pos_embed.proj.bias",
        "blocks.0.norm.weight": "blocks.0.norm.weight",
        "blocks.0.norm.bias": "blocks.0.norm.bias",
        "norm_out.linear.weight": "norm_out.linear.base_layer.weight",
        "norm_out.linear.bias": "norm_out.linear.base_layer.bias",
        "blocks.0.attn.to_q_extra.weight": "blocks.0.attn.to_q_extra.weight",
    }


# ---------------------------------------------------------------------------- sync: files


def test_write_transformer_layout_dtype_and_values(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    state = {"a.weight": torch.randn(4, 3, generator=gen), "a.bias": torch.randn(4, generator=gen)}
    path = write_transformer(state, tmp_path, 1, torch.bfloat16)
    assert path == tmp_path / "v1"
    weights = path / "transformer" / WEIGHTS_FILE
    assert weights.is_file()
    loaded = load_file(str(weights))
    assert set(loaded) == set(state)
    for name, t in state.items():
        assert loaded[name].dtype == torch.bfloat16
        assert torch.equal(loaded[name], t.to(torch.bfloat16))
    # what the engine will hash is what expected_sha256 predicts
    assert {n: tensor_sha256(t) for n, t in loaded.items()} == expected_sha256(state, torch.bfloat16)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v1"]


def test_write_transformer_keeps_the_newest_versions(tmp_path: Path) -> None:
    assert KEEP_VERSIONS == 2
    (tmp_path / "lora_v1.safetensors").write_bytes(b"x")  # another kind of file: left alone
    (tmp_path / "vnotes").mkdir()  # not a version
    for version in (1, 2, 3, 4):
        state = {"w": torch.full((2, 2), float(version))}
        write_transformer(state, tmp_path, version, torch.float32)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["lora_v1.safetensors", "v3", "v4", "vnotes"]
    assert load_file(str(tmp_path / "v4" / "transformer" / WEIGHTS_FILE))["w"].tolist() == [[4.0, 4.0]] * 2
    assert load_file(str(tmp_path / "v3" / "transformer" / WEIGHTS_FILE))["w"].tolist() == [[3.0, 3.0]] * 2


def test_write_transformer_replaces_a_version_and_a_stale_tmp(tmp_path: Path) -> None:
    stale = tmp_path / ".v2.tmp" / "transformer"
    stale.mkdir(parents=True)
    (stale / "junk").write_text("left by a crash")
    write_transformer({"w": torch.zeros(2)}, tmp_path, 2, torch.float32)
    write_transformer({"w": torch.ones(2)}, tmp_path, 2, torch.float32)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v2"]
    assert sorted(p.name for p in (tmp_path / "v2" / "transformer").iterdir()) == [WEIGHTS_FILE]
    assert load_file(str(tmp_path / "v2" / "transformer" / WEIGHTS_FILE))["w"].tolist() == [1.0, 1.0]


def lora_payload(scalings: dict[str, float], rank: int = 4, dims: tuple[int, int] = (6, 5)) -> dict[str, torch.Tensor]:
    """A `miles.models.lora_sync` payload: `<module>.lora_A` [r, in], `.lora_B` [out, r], `.lora_scaling` 0-d."""
    gen = torch.Generator().manual_seed(rank)
    out, inp = dims
    payload: dict[str, torch.Tensor] = {}
    for module, scaling in scalings.items():
        payload[f"{module}.lora_A"] = torch.randn(rank, inp, generator=gen)
        payload[f"{module}.lora_B"] = torch.randn(out, rank, generator=gen)
        payload[f"{module}.lora_scaling"] = torch.tensor(scaling, dtype=torch.float64)
    return payload


MODULES = ("transformer_blocks.0.attn.to_q", "transformer_blocks.1.ff.net.2")


def test_lora_adapter_with_one_integer_alpha(tmp_path: Path) -> None:
    payload = lora_payload(dict.fromkeys(MODULES, 2.0), rank=4)  # peft: alpha 8 / rank 4
    path, alpha = write_lora_adapter(payload, tmp_path / "lora", 1)
    assert path == tmp_path / "lora" / "lora_v1.safetensors"
    assert alpha == 8
    assert isinstance(alpha, int)
    tensors = load_file(str(path))
    assert set(tensors) == {f"{m}.lora_{ab}.weight" for m in MODULES for ab in "AB"}
    for m in MODULES:
        assert torch.equal(tensors[f"{m}.lora_A.weight"], payload[f"{m}.lora_A"])
        assert torch.equal(tensors[f"{m}.lora_B.weight"], payload[f"{m}.lora_B"])  # not folded
        assert tensors[f"{m}.lora_B.weight"].shape == (6, 4)
    assert sorted(p.name for p in (tmp_path / "lora").iterdir()) == ["lora_v1.safetensors"]


@pytest.mark.parametrize(
    "scalings",
    [{MODULES[0]: 0.3, MODULES[1]: 0.3}, {MODULES[0]: 2.0, MODULES[1]: 0.5}],
    ids=["non-integer-alpha", "mixed-scalings"],
)
def test_lora_adapter_folds_other_scalings_into_b(tmp_path: Path, scalings: dict[str, float]) -> None:
    payload = lora_payload(scalings, rank=4)
    path, alpha = write_lora_adapter(payload, tmp_path, 5)
    assert alpha == 4  # alpha == rank: sglang applies no further scale
    tensors = load_file(str(path))
    for m, scaling in scalings.items():
        assert torch.equal(tensors[f"{m}.lora_A.weight"], payload[f"{m}.lora_A"])
        b = tensors[f"{m}.lora_B.weight"]
        assert torch.allclose(b, payload[f"{m}.lora_B"] * scaling, rtol=0, atol=1e-7)
        assert not torch.allclose(b, payload[f"{m}.lora_B"])
        # the delta sglang applies (alpha / r) * B @ A equals peft's scaling * B @ A
        delta = (alpha / 4) * b @ tensors[f"{m}.lora_A.weight"]
        expected = scaling * payload[f"{m}.lora_B"] @ payload[f"{m}.lora_A"]
        assert torch.allclose(delta, expected, atol=1e-6)


def test_lora_adapter_keeps_the_newest_versions(tmp_path: Path) -> None:
    for version in (1, 2, 3):
        write_lora_adapter(lora_payload(dict.fromkeys(MODULES, 1.0)), tmp_path, version)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lora_v2.safetensors", "lora_v3.safetensors"]


def test_lora_adapter_without_lora_a_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no lora_A"):
        write_lora_adapter({"x.lora_B": torch.zeros(2, 2)}, tmp_path, 1)


@pytest.fixture
def tiny_sd3_checkpoint(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Path:
    """tiny-sd3 through `ensure_checkpoint`: the session's build, else the user's cached one (read-only),
    else the session fixture builds it (~40 s, once)."""
    from miles.builtin.checkpoints import builtin_checkpoint_dir, ensure_checkpoint, is_complete
    from miles.utils.paths import DEFAULT_MILES_HOME

    if not is_complete(builtin_checkpoint_dir("tiny-sd3"), "tiny-sd3"):
        cached_home = Path(DEFAULT_MILES_HOME).expanduser()
        if is_complete(cached_home / "models" / "tiny-sd3", "tiny-sd3"):
            monkeypatch.setenv("MILES_HOME", str(cached_home))
        else:
            return request.getfixturevalue("tiny_sd3_dir")
    return ensure_checkpoint("tiny-sd3", progress=False)


def test_transformer_layout_of_tiny_sd3(tiny_sd3_checkpoint: Path) -> None:
    params, linears = transformer_layout(tiny_sd3_checkpoint)
    assert isinstance(params, frozenset)
    assert isinstance(linears, frozenset)
    for name in (
        "transformer_blocks.0.attn.to_q.weight",
        "transformer_blocks.0.attn.to_q.bias",
        "transformer_blocks.0.ff.net.2.weight",
        "context_embedder.weight",
        "proj_out.weight",
        "pos_embed.proj.weight",
    ):
        assert name in params
    assert "pos_embed.pos_embed" not in params  # a buffer, not a parameter
    # exactly the saved tensors minus the buffers
    with safe_open(str(tiny_sd3_checkpoint / "transformer" / WEIGHTS_FILE), "pt") as f:
        saved_names = f.keys()
        shapes = {name: f.get_slice(name).get_shape() for name in saved_names}
    saved = set(shapes)
    assert params <= saved
    assert saved - params <= {"pos_embed.pos_embed"}

    # the linear modules: every one has a weight parameter; convs and norms are not among them
    assert {"transformer_blocks.0.attn.to_q", "transformer_blocks.0.ff.net.2", "proj_out"} <= linears
    assert "pos_embed.proj" not in linears
    assert all(f"{m}.weight" in params for m in linears)
    wrapped = lora_wrapped_names(params, linears)
    assert wrapped["transformer_blocks.0.attn.to_q.weight"] == "transformer_blocks.0.attn.to_q.base_layer.weight"
    assert wrapped["transformer_blocks.0.attn.to_q.bias"] == "transformer_blocks.0.attn.to_q.base_layer.bias"
    assert wrapped["pos_embed.proj.weight"] == "pos_embed.proj.weight"
    assert len(set(wrapped.values())) == len(params)
    # with this transformer the linears are exactly the owners of the 2-D weights
    two_d = {n[: -len(".weight")] for n, shape in shapes.items() if n.endswith(".weight") and len(shape) == 2}
    assert linears == two_d


def test_lora_adapter_with_mixed_ranks_keeps_each_modules_scaling(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    low = lora_payload({"a.to_q": 1.5}, rank=2)
    high = lora_payload({"a.to_k": 0.5}, rank=4)
    path, alpha = write_lora_adapter({**low, **high}, tmp_path, 1)
    assert alpha == 4  # the largest rank
    tensors = load_file(str(path))
    for payload, module in ((low, "a.to_q"), (high, "a.to_k")):
        a, b = tensors[f"{module}.lora_A.weight"], tensors[f"{module}.lora_B.weight"]
        applied = (alpha / a.shape[0]) * b @ a  # sglang: alpha / this module's rank
        wanted = float(payload[f"{module}.lora_scaling"]) * payload[f"{module}.lora_B"] @ payload[f"{module}.lora_A"]
        assert torch.allclose(applied, wanted, atol=1e-6)
    # and what the engine must then hold, under its wrapped names
    from miles.rollout.engines.sglang.sync import expected_sha256, lora_expected_sha256, merged_lora_weight

    base = {
        "a.to_q.weight": torch.randn(6, 5),
        "a.to_q.bias": torch.randn(6),
        "a.to_k.weight": torch.randn(6, 5),
        "norm.weight": torch.randn(5),
    }
    save_file(base, str(tmp_path / "diffusion_pytorch_model.safetensors"))
    expected = lora_expected_sha256(
        [tmp_path / "diffusion_pytorch_model.safetensors"],
        expected_sha256(base, torch.float32),
        path,
        alpha,
        {"a.to_q", "a.to_k"},
        torch.float32,
    )
    assert set(expected) == {
        "a.to_q.base_layer.weight",
        "a.to_q.base_layer.bias",
        "a.to_k.base_layer.weight",
        "norm.weight",
    }
    assert expected["a.to_q.base_layer.bias"] == tensor_sha256(base["a.to_q.bias"])
    assert expected["norm.weight"] == tensor_sha256(base["norm.weight"])
    a, b = tensors["a.to_q.lora_A.weight"], tensors["a.to_q.lora_B.weight"]
    merged = base["a.to_q.weight"].clone().add_(b @ a, alpha=alpha / 2)
    assert torch.equal(merged_lora_weight(base["a.to_q.weight"], a, b, alpha / 2), merged)
    assert expected["a.to_q.base_layer.weight"] == tensor_sha256(merged)
    assert expected["a.to_q.base_layer.weight"] != tensor_sha256(base["a.to_q.weight"])
