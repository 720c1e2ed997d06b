#!/usr/bin/env bash
# Device-side script (lent H200): the SGLang plugin's hooked verify path, eager and in a CUDA graph.
# Usage (repo root, after ../shared/tools/sglang-gpu-bundle and with .sglang-gpu carried):
#   bash bench/h200_sglang.sh [--quick]
# Writes $OUT/sglang_hook.json and $OUT/sglang_hook.log; the kernel builds with nvcc on first use.
set -u
OUT=${OUT:-$PWD/.device-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export MLA_TREE_VERIFY_CACHE=${MLA_TREE_VERIFY_CACHE:-/tmp/mtv-cache}
if [ -f .sglang-gpu/setup.sh ]; then source .sglang-gpu/setup.sh; fi
mkdir -p /tmp/mtvpkg && ln -sfn "$PWD/kernel" /tmp/mtvpkg/mla_tree_verify
export PYTHONPATH=/tmp/mtvpkg:$PWD${PYTHONPATH:+:$PYTHONPATH}
echo "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null)" \
  | tee "$OUT/sglang_hook.log"
timeout ${BUILD_TIMEOUT:-150} python3 -m mla_tree_verify.build >> "$OUT/sglang_hook.log" 2>&1
echo "build rc=$?" | tee -a "$OUT/sglang_hook.log"
timeout ${BENCH_TIMEOUT:-150} python3 bench/sglang_hook.py --out "$OUT/sglang_hook.json" "$@" 2>&1 \
  | tee -a "$OUT/sglang_hook.log" | grep -v Warning | tail -25
echo "bench rc=${PIPESTATUS[0]}"
