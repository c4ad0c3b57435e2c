#!/usr/bin/env bash
# Build the separate Python environment that runs sglang-diffusion servers for miles on a CPU
# machine (about 6 GB). sglang pins torch/transformers/diffusers versions that differ from the
# trainer's, so it never shares the trainer's environment: miles starts its servers with
# `--sglang-python <env>/bin/python` (or MILES_SGLANG_PYTHON).
#
#   bash scripts/build_sglang_env.sh [ENV_DIR]      # default: $HOME/.cache/miles/sglang-env
#
# On GPU machines install the published extra instead: pip install 'miles[sglang]'.
set -euo pipefail
ENV_DIR="${1:-${MILES_SGLANG_ENV:-$HOME/.cache/miles/sglang-env}}"
SGLANG_VERSION=0.5.23
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3

if [ -x "$ENV_DIR/bin/python" ] && "$ENV_DIR/bin/python" -c "import sglang.multimodal_gen.runtime.entrypoints.http_server" 2>/dev/null; then
  echo "sglang environment ready: $ENV_DIR/bin/python"
  exit 0
fi
"$PY" -m venv "$ENV_DIR"
PIP=("$ENV_DIR/bin/python" -m pip install -q --disable-pip-version-check)
# torch first: the pinned CUDA build runs on the CPU, and torchvision must match it
"${PIP[@]}" torch==2.14.1 torchvision==0.29.1
# sglang without its GPU-only requirements (flashinfer, sglang-kernel, cuda-python, ...)
"${PIP[@]}" --no-deps "sglang==$SGLANG_VERSION"
# what the diffusion server imports, at sglang's pins where it has them
"${PIP[@]}" \
  "transformers==5.19.0" "tokenizers==0.23.2" "diffusers==0.37.0" "apache-tvm-ffi==0.1.11" \
  "compressed-tensors==0.18.0" "openai==2.8.0" "sentencepiece==0.2.1" "addict==2.4.0" \
  "cache-dit==1.5.1" "imageio==2.36.0" "imageio-ffmpeg==0.5.1" "opencv-python-headless==4.10.0.84" \
  orjson pybase64 starlette msgspec msgpack pyzmq IPython httpx fastapi "uvicorn>=0.51" uvloop \
  einops dill gguf python-dateutil partial-json-parser python-multipart setproctitle psutil \
  safetensors accelerate pillow numpy scipy pydantic requests aiohttp huggingface_hub protobuf \
  prometheus-client xxhash zstandard
"$ENV_DIR/bin/python" -c "import sglang.multimodal_gen.runtime.entrypoints.http_server" \
  && echo "sglang environment ready: $ENV_DIR/bin/python"
