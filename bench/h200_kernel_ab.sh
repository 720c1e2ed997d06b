#!/usr/bin/env bash
# Device-side A/B of kernel build variants: each variant is the same source with other nvcc flags
# (e.g. "-DMTV_L2_PF=0"), built for sm_90 only and in parallel, then timed by bench/verify.py on the
# same shapes in one process per variant (--no-triton, nothing appended to bench/results).
# Usage (repo root, on the H200):  AB_SHAPES="1,200000,4,8;4,32768,64,64" bash bench/h200_kernel_ab.sh "" "-DX=1" ...
# The empty string is the default build.  Writes $OUT/ab-<i>.json and prints one table per variant.
set -u
OUT=${OUT:-$PWD/.device-out}
mkdir -p "$OUT" /tmp/mtv-ab
mkdir -p /tmp/mtvpkg && ln -sfn "$PWD/kernel" /tmp/mtvpkg/mla_tree_verify
export PYTHONPATH=/tmp/mtvpkg${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
SHAPES=${AB_SHAPES:-1,4096,8,8;1,32768,16,8;1,200000,4,8;16,8192,8,8;1,32768,16,64;4,32768,64,64}
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
i=0
for flags in "$@"; do
  # shellcheck disable=SC2086  # the flags are word-split on purpose
  "$NVCC" -O3 -std=c++17 -lineinfo --expt-relaxed-constexpr $flags -gencode=arch=compute_90,code=sm_90 \
    -shared -Xcompiler -fPIC -Ikernel/csrc -Ikernel/csrc/common -o /tmp/mtv-ab/lib$i.so \
    kernel/csrc/mla_tree_verify.cu > /tmp/mtv-ab/build$i.log 2>&1 &
  i=$((i + 1))
done
wait
i=0
for flags in "$@"; do
  echo "== variant $i: '${flags}' $(grep -c error /tmp/mtv-ab/build$i.log) build errors"
  if [ -f /tmp/mtv-ab/lib$i.so ]; then
    MLA_TREE_VERIFY_LIB=/tmp/mtv-ab/lib$i.so timeout ${AB_TIMEOUT:-150} python3 bench/verify.py --no-triton \
      --no-append --no-resources --out-dir /tmp/mtv-ab/out$i --shapes "$SHAPES" > "$OUT/ab-$i.log" 2>&1
    echo "rc=$?"
    sed -n '/^| B |/,$p' "$OUT/ab-$i.log" | head -14
  else
    tail -5 /tmp/mtv-ab/build$i.log
  fi
  i=$((i + 1))
done
