"""wan2_2 against the real sglang 0.5.23 environment.

  * the names miles' sync gives each Wan expert's tensors are those of the parameters of sglang's own
    WanTransformer3DModel (built, not run, in the sglang environment from the same config), shape for shape;
  * on a machine without GPUs a Wan server cannot sample: its DiT's norms call an sgl_kernel CPU op that
    sglang's CPU build lacks (`sglang_cpu_blocker`), which the server's first (warm-up) request shows.
Rollouts, log-prob recomputes and verified syncs on a server need a GPU machine.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from miles.models.families import get_family
from miles.rollout.engines.sglang.sync import WEIGHTS_FILE, transformer_layout
from miles.utils.sglang_env import gpus_present, resolve_sglang_python

WAN = get_family("wan2_2")
SGLANG_PYTHON = resolve_sglang_python(None)

# run in the sglang environment: sglang's Wan DiT on the meta device from a diffusers transformer config
BUILD_SGLANG_WAN = r"""
import json, os, sys, torch
from sglang.multimodal_gen.runtime.server_args.server_args import ServerArgs, set_global_server_args
config_path = sys.argv[1]
set_global_server_args(ServerArgs.from_kwargs(
    model_path=os.path.dirname(os.path.dirname(config_path)), model_id="Wan2.2-T2V-A14B-Diffusers", num_gpus=1))
from sglang.multimodal_gen.runtime.distributed import maybe_init_distributed_environment_and_model_parallel
maybe_init_distributed_environment_and_model_parallel(1, 1)
from sglang.multimodal_gen.configs.models.dits.wanvideo import WanVideoConfig
from sglang.multimodal_gen.runtime.models.dits.wanvideo import WanTransformer3DModel
hf = json.load(open(config_path))
config = WanVideoConfig()
config.update_model_arch({k: v for k, v in hf.items() if not k.startswith("_")})
with torch.device("meta"):
    model = WanTransformer3DModel(config, hf_config=hf)
print("MILES-PARAMS " + json.dumps({n: list(p.shape) for n, p in model.named_parameters()}))
"""


@pytest.fixture(scope="module")
def wan_expert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint directory with one two-block Wan expert (the layout sglang reads its config from)."""
    import torch
    from diffusers import WanTransformer3DModel

    root = tmp_path_factory.mktemp("wan_expert")
    torch.manual_seed(0)
    WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=4,
        out_channels=4,
        text_dim=32,
        freq_dim=32,
        ffn_dim=64,
        num_layers=2,
        cross_attn_norm=True,
        rope_max_seq_len=32,
    ).save_pretrained(root / "transformer")
    return root


def test_sync_names_are_the_parameters_of_sglangs_wan_dit(wan_expert_dir: Path, tmp_path: Path) -> None:
    assert SGLANG_PYTHON is not None
    script = tmp_path / "build.py"
    script.write_text(BUILD_SGLANG_WAN)
    proc = subprocess.run(
        [SGLANG_PYTHON, str(script), str(wan_expert_dir / "transformer" / "config.json")],
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29571"},
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("MILES-PARAMS ")]
    assert lines, proc.stderr[-3000:]
    sglang = json.loads(lines[-1][len("MILES-PARAMS ") :])
    params, _ = transformer_layout(wan_expert_dir)
    state = load_file(str(wan_expert_dir / "transformer" / WEIGHTS_FILE))
    ours = WAN.to_engine_tensors({k: v for k, v in state.items() if k in params})
    assert set(ours) == set(sglang), (sorted(set(ours) - set(sglang)), sorted(set(sglang) - set(ours)))
    assert {k: list(v.shape) for k, v in ours.items()} == sglang


@pytest.fixture(scope="module")
def tiny_wan_dir(miles_session_home: Path) -> Path:
    from miles.builtin.checkpoints import ensure_checkpoint, is_builtin_model

    if not is_builtin_model("tiny-wan2_2"):
        pytest.skip("the built-in tiny-wan2_2 is not in this tree yet")
    return ensure_checkpoint("tiny-wan2_2", progress=False)


@pytest.mark.extended  # a server start that fails on its warm-up: minutes, for one line of evidence
@pytest.mark.skipif(gpus_present(), reason="the blocker is for machines without GPUs")
def test_wan_server_cannot_sample_on_cpu_for_the_blockers_reason(tiny_wan_dir: Path, tmp_path: Path) -> None:
    from miles.rollout.engines.sglang.server import EngineStartError, ServerSpec, SglangServer

    assert SGLANG_PYTHON is not None
    spec = ServerSpec(
        python=SGLANG_PYTHON,
        model_path=str(tiny_wan_dir),
        model_id=WAN.sglang_model_id,
        family_options=WAN.sglang_server_options("fp32", 4.0),
        warmup=(64, 64),
        sleep_on_idle=True,
    )
    server = SglangServer(spec, tmp_path)
    server.start()
    try:
        with pytest.raises(EngineStartError):
            server.wait_ready(timeout=300)
    finally:
        server.stop()
    log = server.log_path.read_text(errors="replace")
    assert "fused_norm_scale_shift_cpu" in log and "layernorm.py" in log, log[-2000:]
    assert "fused_norm_scale_shift_cpu" in WAN.sglang_cpu_blocker
    print(f"wan2_2 on a CPU sglang server: {sys.platform}: {WAN.sglang_cpu_blocker}")
