#!/usr/bin/env bash
# Device-side A/B of kernel builds, timed side by side in one session. Each variant is either nvcc flags for
# this checkout's source (e.g. "-DMTV_X=0"; "" is the default build) or "@DIR": the kernel/ tree found in DIR
# (another revision, e.g. `mkdir -p /tmp/head && git archive HEAD kernel | tar -x -C /tmp/head` -> "@/tmp/head")
# built with its own default flags. All are built for sm_90 only (in parallel, each cached apart), then timed
# by bench/verify.py on the same shapes, one process per variant (--no-triton, nothing appended to
# bench/results). The Python side (split choice, checks) is always this checkout's: a tree whose library
# accepts fewer splits (MAX_SPLITS) than this checkout chooses fails its launches with ARG_SPLITS.
# Usage (repo root, on the H200):  AB_SHAPES="1,200000,4,8;4,32768,64,64" bash bench/h200_kernel_ab.sh "" "-DX=1" "@/tmp/head"
# Writes $OUT/ab-<i>.log and prints one table per variant.
set -u
OUT=${OUT:-$PWD/.device-out}
mkdir -p "$OUT" /tmp/mtv-ab
mkdir -p /tmp/mtvpkg && ln -sfn "$PWD/kernel" /tmp/mtvpkg/mla_tree_verify
export PYTHONPATH=/tmp/mtvpkg${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
SHAPES=${AB_SHAPES:-1,4096,8,8;1,32768,16,8;1,200000,4,8;16,8192,8,8;1,32768,16,64;4,32768,64,64}
GENCODE=--gencode=-gencode=arch=compute_90,code=sm_90
i=0
for v in "$@"; do
  if [ "${v#@}" != "$v" ]; then  # another kernel/ tree: its own package, its own default flags
    tree=${v#@}
    if [ ! -d "$tree/kernel" ]; then echo "variant $i: no kernel/ in $tree" > /tmp/mtv-ab/build$i.log; i=$((i + 1)); continue; fi
    mkdir -p /tmp/mtv-ab/pkg$i && ln -sfn "$(cd "$tree" && pwd)/kernel" /tmp/mtv-ab/pkg$i/mla_tree_verify
    PYTHONPATH=/tmp/mtv-ab/pkg$i MLA_TREE_VERIFY_CACHE=/tmp/mtv-ab/cache$i MLA_TREE_VERIFY_NVCC_FLAGS="" \
      python3 -m mla_tree_verify.build $GENCODE > /tmp/mtv-ab/build$i.log 2>&1 &
  else
    MLA_TREE_VERIFY_CACHE=/tmp/mtv-ab/cache MLA_TREE_VERIFY_NVCC_FLAGS="$v" \
      python3 -m mla_tree_verify.build $GENCODE > /tmp/mtv-ab/build$i.log 2>&1 &
  fi
  i=$((i + 1))
done
wait
i=0
for v in "$@"; do
  lib=$(tail -1 /tmp/mtv-ab/build$i.log)
  echo "== variant $i: '${v}'"
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
