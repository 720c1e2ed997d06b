#!/usr/bin/env bash
# Device-side script for the lent H200: `shadowd selftest --sanitize` as a user runs it on the deployment GPU, and
# the negative control (the real memcheck fails a planted out-of-bounds write in an mtv_-named kernel).
# Usage (repo root): bash bench/h200_sanitize.sh   (SAN_TIMEOUT: seconds per tool, default 60)
# Writes logs under $OUT (default ./.device-out) and prints a summary last.
set -u
OUT=${OUT:-$PWD/.device-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MLA_TREE_VERIFY_CACHE=/tmp/mtv-cache
# the package importable as mla_tree_verify from the checkout, and shadowd itself
mkdir -p /tmp/mtvpkg && ln -sfn "$PWD/kernel" /tmp/mtvpkg/mla_tree_verify
export PYTHONPATH=/tmp/mtvpkg:$PWD${PYTHONPATH:+:$PYTHONPATH}
# the tools' whole outputs (shadowd.sanitize keeps them in a temporary directory) come back with $OUT
export TMPDIR=/tmp/sanitize-logs && mkdir -p "$TMPDIR"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }

note "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null)"
note "commit ${SHADOWD_BENCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)$(git diff --quiet 2>/dev/null || echo '+changes')}"
note "$(python3 -c 'import sys,torch,triton;print("python",sys.version.split()[0],"torch",torch.__version__,"triton",triton.__version__)' 2>&1)"
note "$(compute-sanitizer --version 2>&1 | tail -1)"

# the build (nvcc, on the CPUs) and the negative control (Triton, on the GPU) side by side
timeout 150 python3 -m mla_tree_verify.build > "$OUT/build.log" 2>&1 &
build_pid=$!
timeout 90 python3 -m pytest tests/cli/test_sanitize.py -q -rs -p no:cacheprovider > "$OUT/control.log" 2>&1
control_rc=$?
wait $build_pid
note "build rc=$? $(tail -1 "$OUT/build.log")"
note "control (tests/cli/test_sanitize.py) rc=$control_rc: $(tail -1 "$OUT/control.log")"
grep -E "^(FAILED|ERROR|SKIPPED)" "$OUT/control.log" | head -5 >> "$SUMMARY"

t0=$(date +%s)
timeout 270 python3 -m shadowd selftest --quick --sanitize --sanitize-timeout "${SAN_TIMEOUT:-60}" \
  > "$OUT/selftest.log" 2>&1
note "selftest --quick --sanitize rc=$? in $(( $(date +%s) - t0 )) s"
cat "$OUT/selftest.log" >> "$SUMMARY"

(cd "$TMPDIR" && tar czf "$OUT/sanitize-logs.tgz" . 2>/dev/null)
(cd "$OUT" && tar czf logs.tgz ./*.log 2>/dev/null && rm -f ./*.log)
echo "======== SUMMARY"
cat "$SUMMARY"
