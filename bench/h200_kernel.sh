#!/usr/bin/env bash
# Device-side script for the lent H200: build, GPU tests, compute-sanitizer, benchmark.
# Usage (repo root): bash bench/h200_kernel.sh [build] [tests] [sanitize] [ncu] [host] [bench|bench-quick]
# On the lent machine: source .sglang-gpu/setup.sh first (SGLang's Triton baseline); export
# MLA_TREE_VERIFY_NVCC_FLAGS to build and test a variant (it is part of the library cache key).
# Writes logs under $OUT (default ./.device-out); every stage has a timeout and failures do
# not stop later stages.  Prints a short summary last.
set -u
OUT=${OUT:-$PWD/.device-out}
mkdir -p "$OUT"
STAGES=${*:-build tests sanitize bench}
export PYTHONUNBUFFERED=1
export MLA_TREE_VERIFY_CACHE=/tmp/mtv-cache
if [ -f .sglang-gpu/setup.sh ]; then source .sglang-gpu/setup.sh; fi
PY=python3
# make the package importable as mla_tree_verify from the checkout
mkdir -p /tmp/mtvpkg && ln -sfn "$PWD/kernel" /tmp/mtvpkg/mla_tree_verify
export PYTHONPATH=/tmp/mtvpkg${PYTHONPATH:+:$PYTHONPATH}
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }

note "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader 2>/dev/null)"
note "python $($PY -c 'import sys,torch;print(sys.version.split()[0], "torch", torch.__version__)' 2>&1)"
$PY -c 'import sglang; print("sglang", sglang.__version__)' 2>&1 | tee -a "$SUMMARY"

for st in $STAGES; do
  case $st in
    build)
      timeout 180 $PY -m mla_tree_verify.build > "$OUT/build.log" 2>&1; rc=$?
      note "build rc=$rc $(tail -1 "$OUT/build.log")"
      timeout 120 $PY -m mla_tree_verify.compile_check > "$OUT/compile_check.log" 2>&1
      note "compile_check rc=$?"; cat "$OUT/compile_check.log" >> "$SUMMARY" ;;
    tests)
      timeout ${TEST_TIMEOUT:-300} $PY -m pytest tests/kernel -q --timeout 240 -p no:cacheprovider \
        -rs > "$OUT/pytest.log" 2>&1; rc=$?
      note "pytest rc=$rc: $(tail -1 "$OUT/pytest.log")"
      grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -20 >> "$SUMMARY" ;;
    sanitize)
      for tool in memcheck racecheck initcheck synccheck; do
        log="$OUT/sanitize-$tool.log"
        # initcheck checks every kernel: filtered, it cannot see the writes of PyTorch's kernels (shadowd.sanitize)
        filt="--kernel-name kns=mtv_"; [ $tool = initcheck ] && filt=""
        timeout ${SAN_TIMEOUT:-100} compute-sanitizer --tool $tool $filt --print-limit 20 \
          $PY -m mla_tree_verify.sanitize > "$log" 2>&1; rc=$?
        if ! grep -q "ERROR SUMMARY" "$log"; then  # filter syntax refused: check every kernel instead
          timeout ${SAN_TIMEOUT:-100} compute-sanitizer --tool $tool --print-limit 20 \
            $PY -m mla_tree_verify.sanitize > "$log" 2>&1; rc=$?
        fi
        note "sanitizer $tool rc=$rc: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -1)"
        grep -E "^=========" "$log" | grep -v "ERROR SUMMARY" | head -8 >> "$SUMMARY"
      done ;;
    ncu)
      IFS=';' read -ra NSH <<< "${NCU_SHAPES:-1,32768,16,8;4,32768,64,64}"
      for sh in "${NSH[@]}"; do
        timeout ${NCU_TIMEOUT:-90} ncu --clock-control none --section SpeedOfLight --section WarpStateStats \
          --section MemoryWorkloadAnalysis --section Occupancy --section ComputeWorkloadAnalysis \
          -k regex:mtv_fwd -c 1 $PY bench/verify.py --no-triton --no-append --out-dir /tmp/ncu-out --shapes "$sh" \
          > "$OUT/ncu-${sh//,/_}.log" 2>&1
        note "ncu $sh rc=$?"
        grep -E "Duration|Throughput|Stall|Warp Cycles|Achieved Occupancy|Issued Ipc|Hit Rate|Busy|Executed Ipc" \
          "$OUT/ncu-${sh//,/_}.log" | head -30 >> "$SUMMARY"
      done ;;
    host)
      timeout ${HOST_TIMEOUT:-150} $PY bench/verify_host.py --out-dir "$OUT" > "$OUT/host.log" 2>&1
      note "host rc=$?"; grep "^|" "$OUT/host.log" | tail -3 >> "$SUMMARY" ;;
    bench|bench-quick)
      q=""; [ "$st" = bench-quick ] && q="--quick"
      timeout ${BENCH_TIMEOUT:-330} $PY bench/verify.py $q --out-dir "$OUT" > "$OUT/bench.log" 2>&1; rc=$?
      note "bench rc=$rc"
      cp bench/results/verify-$(date -u +%F).md "$OUT/" 2>/dev/null
      sed -n '/^| B |/,$p' "$OUT/bench.log" | head -20 >> "$SUMMARY" ;;
  esac
done
# at most 8 files come back: pack the logs
(cd "$OUT" && tar czf logs.tgz *.log 2>/dev/null && rm -f *.log)
echo "======== SUMMARY"; cat "$SUMMARY"
