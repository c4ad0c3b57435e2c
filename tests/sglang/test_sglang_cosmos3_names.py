"""cosmos3 against the real sglang 0.5.23 environment, without a server: the names and shapes miles' sync and
weight checker give tiny-cosmos3's tensors are the parameters of sglang's own Cosmos3OmniTransformer (built, not
run, on the meta device in the sglang environment from the checkpoint's config), and the hard-coded copy the fast
tests use (tests/models/test_cosmos3_sglang_names.py) is still what sglang builds."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from safetensors.torch import load_file

from miles.models.families import get_family
from miles.rollout.engines.sglang.sync import WEIGHTS_FILE, transformer_layout
from miles.utils.sglang_env import resolve_sglang_python

COSMOS3 = get_family("cosmos3")
SGLANG_PYTHON = resolve_sglang_python(None)

BUILD_SGLANG_COSMOS3 = r"""
import json, os, sys, torch
from sglang.multimodal_gen.runtime.server_args.server_args import ServerArgs, set_global_server_args
config_path = sys.argv[1]
set_global_server_args(ServerArgs.from_kwargs(model_path=os.path.dirname(os.path.dirname(config_path)), num_gpus=1))
from sglang.multimodal_gen.runtime.distributed import maybe_init_distributed_environment_and_model_parallel
maybe_init_distributed_environment_and_model_parallel(1, 1)
from sglang.multimodal_gen.configs.models.dits.cosmos3video import Cosmos3VideoConfig
from sglang.multimodal_gen.runtime.models.dits.cosmos3video import Cosmos3OmniTransformer
hf = json.load(open(config_path))
config = Cosmos3VideoConfig()
config.update_model_arch({k: v for k, v in hf.items() if not k.startswith("_")})
with torch.device("meta"):
    model = Cosmos3OmniTransformer(config, hf_config=hf)
print("MILES-PARAMS " + json.dumps({n: list(p.shape) for n, p in model.named_parameters()}))
"""


def _fast_tests() -> object:
    """tests/models/test_cosmos3_sglang_names.py as a module (the tests are no package)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "models" / "test_cosmos3_sglang_names.py"
    spec = importlib.util.spec_from_file_location("_cosmos3_sglang_names", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sync_names_are_the_parameters_of_sglangs_cosmos3_dit(tiny_cosmos3_dir: Path, tmp_path: Path) -> None:
    """`tiny_cosmos3_dir` (tests/conftest.py): tiny-cosmos3's layout, which is all sglang reads here."""
    expected = _fast_tests().SGLANG_TINY_PARAMS  # type: ignore[attr-defined]
    assert SGLANG_PYTHON is not None
    script = tmp_path / "build.py"
    script.write_text(BUILD_SGLANG_COSMOS3)
    proc = subprocess.run(
        [SGLANG_PYTHON, str(script), str(tiny_cosmos3_dir / "transformer" / "config.json")],
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29573"},
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("MILES-PARAMS ")]
    assert lines, proc.stderr[-3000:]
    sglang = json.loads(lines[-1][len("MILES-PARAMS ") :])
    assert sglang == expected
    params, _ = transformer_layout(tiny_cosmos3_dir)
    state = load_file(str(tiny_cosmos3_dir / "transformer" / WEIGHTS_FILE))
    ours = COSMOS3.to_engine_tensors({k: v for k, v in state.items() if k in params})
    assert {k: list(v.shape) for k, v in ours.items()} == sglang
