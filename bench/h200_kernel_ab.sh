#!/usr/bin/env bash
# Device-side A/B of kernel build variants: each variant is the same source with other nvcc flags
# (e.g. "-DMTV_X=0"), built by `python -m mla_tree_verify.build` for sm_90 only (in parallel, each
# cached under its own flags), then timed by bench/verify.py on the same shapes in one process per
# variant (--no-triton, nothing appended to bench/results).
# Usage (repo root, on the H200):  AB_SHAPES="1,200000,4,8;4,32768,64,64" bash bench/h200_kernel_ab.sh "" "-DX=1" ...
# The empty string is the default build.  Writes $OUT/ab-<i>.log and prints one table per variant.
set -u
OUT=${OUT:-$PWD/.device-out}
mkdir -p "$OUT" /tmp/mtv-ab
mkdir -p /tmp/mtvpkg && ln -sfn "$PWD/kernel" /tmp/mtvpkg/mla_tree_verify
export PYTHONPATH=/tmp/mtvpkg${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export MLA_TREE_VERIFY_CACHE=${MLA_TREE_VERIFY_CACHE:-/tmp/mtv-ab/cache}
SHAPES=${AB_SHAPES:-1,4096,8,8;1,32768,16,8;1,200000,4,8;16,8192,8,8;1,32768,16,64;4,32768,64,64}
i=0
for flags in "$@"; do
  MLA_TREE_VERIFY_NVCC_FLAGS="$flags" python3 -m mla_tree_verify.build \
    --gencode=-gencode=arch=compute_90,code=sm_90 > /tmp/mtv-ab/build$i.log 2>&1 &
  i=$((i + 1))
done
wait
i=0
for flags in "$@"; do
  lib=$(tail -1 /tmp/mtv-ab/build$i.log)
  echo "== variant $i: '${flags}'"
  if [ -f "$lib" ]; then
    MLA_TREE_VERIFY_LIB=$lib timeout ${AB_TIMEOUT:-150} python3 bench/verify.py --no-triton \
      --no-append --no-resources --out-dir /tmp/mtv-ab/out$i --shapes "$SHAPES" > "$OUT/ab-$i.log" 2>&1
    echo "rc=$?"
    sed -n '/^| B |/,$p' "$OUT/ab-$i.log" | head -14
  else
    echo "build failed:"; tail -5 /tmp/mtv-ab/build$i.log
  fi
  i=$((i + 1))
done
