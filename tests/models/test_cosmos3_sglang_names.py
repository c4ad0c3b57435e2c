"""cosmos3's weights under the names sglang 0.5.23's Cosmos3 port gives them, without a server.

sglang is not importable from miles' python (it lives in its own environment), so the expectations come from
sglang's own text where it is on this machine, else from a hard-coded copy:
  * `_build_cosmos3_param_names_mapping` is read out of sglang's `configs/models/dits/cosmos3video.py` (the function
    alone, executed here: it only builds a dict of regexes) and applied to every parameter of tiny-cosmos3 the way
    sglang's `get_param_names_mapping` chains them; each name must land where `to_engine_tensors` puts it, and each
    fused member at its merge index (q, k, v; gate, up);
  * `SGLANG_TINY_PARAMS` is the parameter list (and shapes) of sglang's `Cosmos3OmniTransformer` built on the meta
    device from tiny-cosmos3's config in the sglang environment (tests/sglang/test_sglang_cosmos3_names.py rebuilds
    it there and compares): note the token embedding padded to 512 rows (vocab 496, sglang pads to 64s) and no
    `lm_head` / `norm`.
The digests the weight checker compares follow: fused tensors concatenated, the fp32 time embedder widened from the
DiT precision (sglang's post_load_weights keeps it fp32), the padded rows zero.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from miles.models.cosmos3.config import sglang_module
from miles.models.families import get_family
from miles.rollout.engines.sglang import sync as wsync

COSMOS3 = get_family("cosmos3")
TINY_LAYERS = 2


def _layer_params(i: int) -> dict[str, list[int]]:
    und, gen = f"language_model.layers.{i}.", f"gen_layers.{i}."
    return {
        f"{und}self_attn.to_qkv.weight": [512, 256],
        f"{und}self_attn.to_out.weight": [256, 256],
        f"{und}self_attn.norm_q.weight": [64],
        f"{und}self_attn.norm_k.weight": [64],
        f"{und}input_layernorm.weight": [256],
        f"{und}post_attention_layernorm.weight": [256],
        f"{und}mlp.gate_up_proj.weight": [1024, 256],
        f"{und}mlp.down_proj.weight": [256, 512],
        f"{gen}cross_attention.to_qkv.weight": [512, 256],
        f"{gen}cross_attention.to_out.weight": [256, 256],
        f"{gen}cross_attention.norm_q.weight": [64],
        f"{gen}cross_attention.norm_k.weight": [64],
        f"{gen}input_layernorm.weight": [256],
        f"{gen}post_attention_layernorm.weight": [256],
        f"{gen}mlp.gate_up_proj.weight": [1024, 256],
        f"{gen}mlp.down_proj.weight": [256, 512],
    }


# sglang 0.5.23's Cosmos3OmniTransformer from tiny-cosmos3's transformer config (hidden 256, 4 heads / 2 KV heads of
# 64, intermediate 512, vocab 496, latent patch 8 x 2 channels), read off the module's named_parameters()
SGLANG_TINY_PARAMS: dict[str, list[int]] = {
    "language_model.embed_tokens.weight": [512, 256],
    **{k: v for i in range(TINY_LAYERS) for k, v in _layer_params(i).items()},
    "proj_in.weight": [256, 128],
    "proj_in.bias": [256],
    "proj_out.weight": [128, 256],
    "proj_out.bias": [128],
    "time_embedder.linear_1.weight": [256, 256],
    "time_embedder.linear_1.bias": [256],
    "time_embedder.linear_2.weight": [256, 256],
    "time_embedder.linear_2.bias": [256],
    "norm_moe_gen.weight": [256],
}


def tiny_cosmos3_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """A state dict shaped as tiny-cosmos3's Cosmos3OmniTransformer (diffusers' names), random values."""
    g = torch.Generator().manual_seed(seed)
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (496, 256), "lm_head.weight": (496, 256)}
    shapes.update({"norm.weight": (256,), "norm_moe_gen.weight": (256,)})
    shapes.update({"proj_in.weight": (256, 128), "proj_in.bias": (256,)})
    shapes.update({"proj_out.weight": (128, 256), "proj_out.bias": (128,)})
    for k in (1, 2):
        shapes.update({f"time_embedder.linear_{k}.weight": (256, 256), f"time_embedder.linear_{k}.bias": (256,)})
    for i in range(TINY_LAYERS):
        p = f"layers.{i}."
        for n in ("input_layernorm", "post_attention_layernorm"):
            shapes[f"{p}{n}.weight"] = shapes[f"{p}{n}_moe_gen.weight"] = (256,)
        for mlp in ("mlp", "mlp_moe_gen"):
            shapes.update({f"{p}{mlp}.gate_proj.weight": (512, 256), f"{p}{mlp}.up_proj.weight": (512, 256)})
            shapes[f"{p}{mlp}.down_proj.weight"] = (256, 512)
        for proj, rows in (("q", 256), ("k", 128), ("v", 128)):
            shapes[f"{p}self_attn.to_{proj}.weight"] = shapes[f"{p}self_attn.add_{proj}_proj.weight"] = (rows, 256)
        shapes.update({f"{p}self_attn.to_out.weight": (256, 256), f"{p}self_attn.to_add_out.weight": (256, 256)})
        for n in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
            shapes[f"{p}self_attn.{n}.weight"] = (64,)
    return {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}


def sglang_mapping_source() -> str | None:
    """The text of sglang's Cosmos3 DiT config in the sglang environment on this machine, or None."""
    from miles.utils.sglang_env import resolve_sglang_python

    python = resolve_sglang_python(None)
    if python is None:
        return None
    env = Path(python).resolve().parent.parent if Path(python).parent.name == "bin" else None
    for root in ([env] if env else []) + [Path(python).parent.parent]:
        for path in root.glob("lib/python3*/site-packages/sglang/multimodal_gen/configs/models/dits/cosmos3video.py"):
            return path.read_text()
    return None


def sglang_mapping(gated_mlp: bool = True) -> dict[str, Any] | None:
    """sglang's own `_build_cosmos3_param_names_mapping(gated_mlp)`, the function executed alone."""
    source = sglang_mapping_source()
    if source is None:
        return None
    tree = ast.parse(source)
    func = next(
        n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_build_cosmos3_param_names_mapping"
    )
    namespace: dict[str, Any] = {}
    exec(compile(ast.Module(body=[func], type_ignores=[]), "cosmos3video.py", "exec"), namespace)
    return namespace["_build_cosmos3_param_names_mapping"](gated_mlp)


def sglang_map_name(mapping: dict[str, Any], name: str) -> tuple[str, int | None]:
    """sglang's `get_param_names_mapping` (runtime/loader/utils.py): the first matching pattern rewrites the name,
    chained until none applies; a tuple target carries the merge index into its fused parameter."""
    merge_index = None
    applied: set[str] = set()
    for _ in range(max(8, 2 * len(mapping))):
        for pattern, target in mapping.items():
            if pattern in applied or re.match(pattern, name) is None:
                continue
            if isinstance(target, tuple):
                target, index = target[0], target[1]
            else:
                index = None
            new = re.sub(pattern, target, name)
            if new != name:
                merge_index = index if index is not None else merge_index
                name = new
                applied.add(pattern)
                break
        else:
            break
    return name, merge_index


# ---- the module names ------------------------------------------------------------------------------------------
def test_fused_modules_in_sglangs_order() -> None:
    assert COSMOS3.engine_module("layers.1.self_attn.add_k_proj") == (
        "gen_layers.1.cross_attention.to_qkv",
        [f"layers.1.self_attn.add_{x}_proj" for x in "qkv"],
    )
    assert COSMOS3.engine_module("layers.0.self_attn.to_v") == (
        "language_model.layers.0.self_attn.to_qkv",
        [f"layers.0.self_attn.to_{x}" for x in "qkv"],
    )
    assert COSMOS3.engine_module("layers.0.mlp_moe_gen.up_proj") == (
        "gen_layers.0.mlp.gate_up_proj",
        ["layers.0.mlp_moe_gen.gate_proj", "layers.0.mlp_moe_gen.up_proj"],
    )
    assert COSMOS3.engine_module("layers.3.mlp.gate_proj") == (
        "language_model.layers.3.mlp.gate_up_proj",
        ["layers.3.mlp.gate_proj", "layers.3.mlp.up_proj"],
    )
    renames = {
        "layers.0.self_attn.to_add_out": "gen_layers.0.cross_attention.to_out",
        "layers.0.self_attn.norm_added_q": "gen_layers.0.cross_attention.norm_q",
        "layers.0.input_layernorm_moe_gen": "gen_layers.0.input_layernorm",
        "layers.0.post_attention_layernorm_moe_gen": "gen_layers.0.post_attention_layernorm",
        "layers.0.mlp_moe_gen.down_proj": "gen_layers.0.mlp.down_proj",
        "layers.0.self_attn.to_out": "language_model.layers.0.self_attn.to_out",
        "layers.0.self_attn.norm_q": "language_model.layers.0.self_attn.norm_q",
        "layers.0.input_layernorm": "language_model.layers.0.input_layernorm",
        "embed_tokens": "language_model.embed_tokens",
        "vae2llm": "proj_in",
        "llm2vae": "proj_out",
        "proj_in": "proj_in",
        "time_embedder.linear_1": "time_embedder.linear_1",
        "norm_moe_gen": "norm_moe_gen",
        "lm_head": "",
        "norm": "",
    }
    assert {m: COSMOS3.engine_module(m)[0] for m in renames} == renames
    # a dense (squared-ReLU) checkpoint keeps up/down apart
    assert sglang_module("layers.0.mlp_moe_gen.up_proj", gated_mlp=False) == (
        "gen_layers.0.mlp.up_proj",
        ["layers.0.mlp_moe_gen.up_proj"],
    )
    assert sglang_module("layers.0.mlp.up_proj", gated_mlp=False)[0] == "language_model.layers.0.mlp.up_proj"


def test_engine_tensors_are_sglangs_parameters_shape_for_shape() -> None:
    state = tiny_cosmos3_state()
    engine = COSMOS3.to_engine_tensors(state)
    assert {k: list(v.shape) for k, v in engine.items()} == SGLANG_TINY_PARAMS
    for i in range(TINY_LAYERS):
        p = f"layers.{i}."
        gen_qkv = torch.cat([state[f"{p}self_attn.add_{x}_proj.weight"] for x in "qkv"])
        assert torch.equal(engine[f"gen_layers.{i}.cross_attention.to_qkv.weight"], gen_qkv)
        und_qkv = torch.cat([state[f"{p}self_attn.to_{x}.weight"] for x in "qkv"])
        assert torch.equal(engine[f"language_model.layers.{i}.self_attn.to_qkv.weight"], und_qkv)
        gate_up = torch.cat([state[f"{p}mlp_moe_gen.gate_proj.weight"], state[f"{p}mlp_moe_gen.up_proj.weight"]])
        assert torch.equal(engine[f"gen_layers.{i}.mlp.gate_up_proj.weight"], gate_up)
        und_gate_up = torch.cat([state[f"{p}mlp.gate_proj.weight"], state[f"{p}mlp.up_proj.weight"]])
        assert torch.equal(engine[f"language_model.layers.{i}.mlp.gate_up_proj.weight"], und_gate_up)
    embed = engine["language_model.embed_tokens.weight"]
    assert torch.equal(embed[:496], state["embed_tokens.weight"])
    assert torch.count_nonzero(embed[496:]) == 0
    with pytest.raises(ValueError, match=r"gen_layers\.0\.cross_attention\.to_qkv\.weight .*add_v_proj"):
        COSMOS3.to_engine_tensors({k: v for k, v in state.items() if k != "layers.0.self_attn.add_v_proj.weight"})


@pytest.mark.parametrize("gated_mlp", [True, False])
def test_names_agree_with_sglangs_own_mapping(gated_mlp: bool) -> None:
    mapping = sglang_mapping(gated_mlp)
    if mapping is None:
        pytest.skip("no sglang environment here: SGLANG_TINY_PARAMS (hard-coded from it) is the check")
    state = tiny_cosmos3_state()
    if not gated_mlp:
        state = {k: v for k, v in state.items() if ".gate_proj." not in k}
    for name in state:
        module, _, leaf = name.rpartition(".")
        theirs, index = sglang_map_name(mapping, name)
        engine, members = sglang_module(module, gated_mlp)
        assert (f"{engine}.{leaf}" if engine else "") == theirs, name
        if len(members) > 1:
            assert index == members.index(module), (name, index)  # the section this member fills
        else:
            assert index is None, name


# ---- digests the weight checker compares --------------------------------------------------------------------
def test_digests_keep_the_time_embedder_in_fp32(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    state = tiny_cosmos3_state(1)
    digests = wsync.engine_sha256(state, torch.bfloat16, COSMOS3)
    assert set(digests) == set(SGLANG_TINY_PARAMS)
    engine = COSMOS3.to_engine_tensors(state)
    for name in ("time_embedder.linear_1.weight", "time_embedder.linear_2.bias"):
        widened = state[name].to(torch.bfloat16).float()  # what a bf16 server holds: bf16 values in fp32
        assert digests[name] == wsync.tensor_sha256(widened)
        assert digests[name] != wsync.tensor_sha256(state[name].to(torch.bfloat16))
    name = "gen_layers.0.cross_attention.to_qkv.weight"
    assert digests[name] == wsync.tensor_sha256(engine[name].to(torch.bfloat16))
    # the checkpoint's digests read file by file, fused members split across the files, match
    keys = sorted(state)
    save_file({k: state[k] for k in keys[::2]}, str(tmp_path / "a.safetensors"))
    save_file({k: state[k] for k in keys[1::2]}, str(tmp_path / "b.safetensors"))
    files = [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]
    assert wsync.files_engine_sha256(files, set(state), torch.bfloat16, COSMOS3) == digests
    # a full sync by handle sends the fp32-kept tensors at the DiT precision, the rest as they are
    sent = wsync.cast_kept_modules(state, torch.bfloat16, COSMOS3)
    assert sent["time_embedder.linear_1.weight"].dtype == torch.bfloat16
    assert sent["layers.0.self_attn.to_q.weight"] is state["layers.0.self_attn.to_q.weight"]
    assert wsync.cast_kept_modules(state, torch.bfloat16, get_family("flux")) is state


def test_lora_digests_merge_each_member_under_the_wrapped_fused_name(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    state = tiny_cosmos3_state(2)
    save_file(state, str(tmp_path / "w.safetensors"))
    files = [tmp_path / "w.safetensors"]
    base = wsync.files_engine_sha256(files, set(state), torch.bfloat16, COSMOS3)
    g = torch.Generator().manual_seed(3)
    adapted = ("layers.0.self_attn.add_q_proj", "layers.0.self_attn.add_k_proj", "layers.0.self_attn.add_v_proj")
    adapted += ("layers.1.mlp_moe_gen.gate_proj", "layers.1.mlp_moe_gen.up_proj", "layers.1.self_attn.to_add_out")
    pairs = {
        m: (torch.randn(4, state[f"{m}.weight"].shape[1], generator=g), torch.randn(state[f"{m}.weight"].shape[0], 4))
        for m in adapted
    }
    linears = {k.rpartition(".")[0] for k, v in state.items() if v.dim() == 2 and k != "embed_tokens.weight"}
    digests = wsync.lora_merged_sha256(files, base, pairs, 8, linears, torch.bfloat16, family=COSMOS3)
    wrapped = {
        "gen_layers.0.cross_attention.to_qkv",
        "gen_layers.1.mlp.gate_up_proj",
        "gen_layers.1.cross_attention.to_out",
        "language_model.layers.0.self_attn.to_qkv",
        "time_embedder.linear_1",
        "proj_in",
    }
    for module in wrapped:
        assert f"{module}.base_layer.weight" in digests and f"{module}.weight" not in digests
    assert "language_model.embed_tokens.weight" in digests and "norm_moe_gen.weight" in digests
    assert "base_layer" not in "".join(k for k in digests if "embed_tokens" in k or "norm" in k)
    assert not any(k.startswith(("lm_head", "norm.", ".")) for k in digests)
    merged = dict(state)
    for m, (a, b) in pairs.items():
        merged[f"{m}.weight"] = wsync.merged_lora_weight(state[f"{m}.weight"].to(torch.bfloat16), a, b, 8 / 4)
    want = COSMOS3.to_engine_tensors(merged)
    name = "gen_layers.0.cross_attention.to_qkv.weight"
    assert digests["gen_layers.0.cross_attention.to_qkv.base_layer.weight"] == wsync.tensor_sha256(
        want[name].to(torch.bfloat16)
    )
    untouched = "language_model.layers.0.self_attn.to_qkv"
    assert digests[f"{untouched}.base_layer.weight"] == base[f"{untouched}.weight"]
