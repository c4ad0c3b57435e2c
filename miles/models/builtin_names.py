"""The names of the built-in models (torch-free, importing nothing else of miles but the ground floor).

The tiny builds (name -> the builder's `module:function`, `(out_dir, seed=, progress=) -> BuildReport`) and the
digits SFT start points (name -> their optimizer steps); `miles.models.checkpoints` builds them on first use,
`miles.models.tiny.metadata` and the config rules only need to know a name is one of them.
"""

from __future__ import annotations

import os

TINY_SD3_NAME = "tiny-sd3"

# the offline tiny builds: name -> "module:function" with the signature (out_dir, seed=, progress=) -> BuildReport
TINY_BUILDERS: dict[str, str] = {
    TINY_SD3_NAME: "miles.models.sd3.tiny:build_tiny_sd3",
    "tiny-flux": "miles.models.flux.tiny:build_tiny_flux",
    "tiny-qwen-image": "miles.models.qwen_image.tiny:build_tiny_qwen_image",
    "tiny-wan2_2": "miles.models.wan2_2.tiny:build_tiny_wan2_2",
    "tiny-ltx2": "miles.models.ltx.tiny:build_tiny_ltx2",
    "tiny-cosmos3": "miles.models.cosmos3.tiny:build_tiny_cosmos3",
}

SFT_TEACHERS: dict[str, int] = {
    "tiny-sd3-digits-sft": 1000,  # optimizer steps at batch 64
    "tiny-sd3-digits-sft-short": 525,
    "tiny-flux-digits-sft-short": 100,  # digit reward 0.33, where its SFT curve turns steep (0.75 at 125)
    "tiny-qwen-image-digits-sft-short": 150,  # digit reward 0.35 (0.21 at 100, 0.48 at 200)
    "tiny-wan2_2-digits-sft-short": 100,  # eval reward 0.32 (accuracy 0.34; 0.73 at 200, 0.93 at 300)
    "tiny-cosmos3-digits-sft-short": 50,  # eval reward 0.59 on the ten prompts (0.10 at 25 steps)
    "tiny-ltx2-digits-sft-short": 1000,  # video stream only (the ltx patch group)
}
BUILTIN_MODELS = (*TINY_BUILDERS, *SFT_TEACHERS)


def is_builtin_model(name: str | os.PathLike) -> bool:
    return str(name) in BUILTIN_MODELS
