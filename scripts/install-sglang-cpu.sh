#!/usr/bin/env bash
# Installs the real sglang package into a CPU Python environment for the plugin tests (tests/sglang).
#
#   scripts/install-sglang-cpu.sh [python]     # default: .venv/bin/python if present, else python3
#
# sglang==0.5.23 pins torch 2.14.1 (CUDA): it is installed with --no-deps, followed by exactly the
# packages the modules the tests import need. A constraints file keeps torch at the CPU build 2.13.0
# (pip fails instead of replacing it). torchvision is NOT installed: it cannot load beside a CPU torch;
# the tests declare a stand-in for it (tests/sglang/conftest.py). Idempotent; a stamp file skips the work
# when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
SGLANG_VERSION=0.5.23
stamp=$("$PY" -c 'import sys; print(sys.prefix)')/.shadowd-sglang-cpu
want=$(sha256sum "$0" | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ] && "$PY" -c "import sglang, triton" 2>/dev/null; then
  echo "sglang $SGLANG_VERSION already installed (stamp $stamp)"
  exit 0
fi
cons=$(mktemp)
trap 'rm -f "$cons"' EXIT
echo "torch==2.13.0" > "$cons"
"$PY" -m pip install -q -c "$cons" "torch==2.13.0"
"$PY" -m pip install -q --no-deps "sglang==$SGLANG_VERSION"
# What `sglang.srt.layers.attention.triton_backend` and `sglang.srt.plugins` import (CONTEXT.md §2),
# pinned where sglang pins them. triton runs the kernels on the CPU with TRITON_INTERPRET=1; its
# interpreter (3.6) calls int() on 1-element arrays, an error from numpy 2.4 on: numpy<2.4.
"$PY" -m pip install -q -c "$cons" \
  "triton>=3.4" "numpy>=1.26,<2.4" orjson psutil pybase64 requests packaging pillow starlette msgpack msgspec pydantic \
  "pyzmq>=25.1.2" tqdm IPython aiohttp einops setproctitle dill gguf partial_json_parser \
  "transformers==5.19.0" "tokenizers==0.23.2" "sentencepiece==0.2.1" "apache-tvm-ffi==0.1.11" \
  "compressed-tensors==0.18.0" "openai==2.8.0"
"$PY" -c "import torch, sglang; assert torch.__version__.startswith('2.13.0'), torch.__version__; print('sglang', sglang.__version__, 'torch', torch.__version__)"
echo "$want" > "$stamp"
