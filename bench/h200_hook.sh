#!/usr/bin/env bash
# GPU run of the hook: GPU tests + bench/diffstats.py. Usage (device machine, repo root):
#   bash bench/h200_hook.sh        (writes logs under $OUT, prints a summary last)
set -u -o pipefail
OUT=${OUT:-/tmp/h200_hook_out}; mkdir -p "$OUT"
# the kernel package importable (three GPU tests run the real candidate's error words; they skip without it)
export MLA_TREE_VERIFY_CACHE=${MLA_TREE_VERIFY_CACHE:-/tmp/mtv-cache}
mkdir -p /tmp/mtvpkg && ln -sfn "$PWD/kernel" /tmp/mtvpkg/mla_tree_verify
export PYTHONPATH=/tmp/mtvpkg:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" | tee -a "$OUT/gpu.txt"
timeout 300 python3 -m pytest tests/hook/test_gpu.py tests/hook/test_diffstats.py tests/hook/test_control_word.py \
  tests/hook/test_copies.py tests/hook/test_site_adversarial.py tests/hook/test_bundle.py tests/hook/test_capture.py \
  -q -rs -p no:cacheprovider -o addopts="" 2>&1 | tee "$OUT/pytest_gpu.log"
TEST_RC=$?
timeout 330 python3 bench/diffstats.py --out "$OUT/diffstats.json" --results "$OUT/hook-bench.md" 2>&1 \
  | tee "$OUT/bench.log"
BENCH_RC=$?
echo "=== SUMMARY ==="
cat "$OUT/gpu.txt"
tail -n 3 "$OUT/pytest_gpu.log"
echo "pytest rc=$TEST_RC bench rc=$BENCH_RC"
cat "$OUT/hook-bench.md" 2>/dev/null
