#!/usr/bin/env bash
# GPU acceptance (one GPU, under 10 minutes): build a shape-faithful SD3.5-Medium pipeline offline (its real
# transformer config, random weights, tiny text encoders), then `miles train rl` colocated with LoRA, offload
# between phases and in-place (CUDA IPC) weight sync for 2 rollouts; prints peak GPU memory, images/s, train
# step time and the engine-trainer log-prob difference. See bench/gpu_acceptance.py.
#
#   bash bench/gpu_acceptance.sh [ROOT]        # default ROOT: runs/gpu_acceptance
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=${1:-runs/gpu_acceptance}
export HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device visible to torch'; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
[ -f "$ROOT/sd35m-shaped/model_index.json" ] || timeout 300 python bench/gpu_acceptance.py build "$ROOT"
rm -rf "$ROOT/run"
timeout 480 python bench/gpu_acceptance.py run "$ROOT"
