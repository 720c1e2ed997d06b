"""Workloads for Nsight Compute: each launches one kernel of interest a few times, for ``ncu`` to profile one launch.

Usage (on a CUDA machine, under ncu; the H200's Firecracker machines read the hardware counters)::

    ncu --clock-control none --kernel-name regex:_stats_kernel --launch-skip 3 --launch-count 1 \\
        --section SpeedOfLight --section SchedulerStats --section WarpStateStats \\
        python bench/ncu_targets.py stats 2097152
    ncu --clock-control none --kernel-name regex:mtv_fwd_kernel --launch-skip 3 --launch-count 1 ... \\
        python bench/ncu_targets.py verify 1,200000,4,8

* ``stats N`` — the hook's fused statistics kernel (``shadowd.hook.device.launch_stats``, default tiles) over two
  bf16 outputs of N elements (as ``bench/diffstats.py`` times it);
* ``verify B,L,T,H`` — ``mla_tree_verify.tree_verify`` on ``bench/verify.py``'s inputs for that shape (random trees,
  scattered slots).

Nothing is timed here: the numbers are ncu's (issue-slot use, warp stall reasons, achieved bandwidth), which say
what bounds a kernel that the timing benches only show to be slower than its floor.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
LAUNCHES = 6  # ncu skips the first few (compilation, first-touch) and profiles one


def stats(n: int) -> None:
    sys.path.insert(0, str(ROOT))
    from shadowd.hook.device import REC, launch_stats, new_accumulator

    dev = torch.device("cuda")
    b = torch.randn(n, device=dev, dtype=torch.bfloat16)
    c = b + (1e-2 * torch.randn(n, device=dev)).to(torch.bfloat16)
    acc = new_accumulator(dev)
    rec = torch.zeros(4, REC, dtype=torch.float64, device=dev)
    seq = torch.zeros(4, dtype=torch.int64, device=dev)
    sstate = torch.zeros(16, dtype=torch.int64, device=dev)
    sstate[0] = 1  # a sampled call
    dstate = torch.zeros(8, dtype=torch.int64, device=dev)
    for _ in range(LAUNCHES):
        launch_stats(c, b, acc, rec, seq, sstate, dstate, publish=False)
    torch.cuda.synchronize()


def verify(shape: tuple[int, int, int, int]) -> None:
    sys.path.insert(0, str(ROOT / "tests" / "kernel"))
    import conftest  # noqa: F401  (makes mla_tree_verify importable from the checkout)
    import mla_tree_verify
    from mla_tree_verify import testing

    bsz, prefix, draft, heads = shape
    case = testing.make_case([prefix] * bsz, [draft] * bsz, heads, seed=0, device="cuda", tree_kind="random",
                             extra_slots=1024)
    for _ in range(LAUNCHES):
        mla_tree_verify.tree_verify(case.q, case.k_draft, case.kv_buffer, case.qo_indptr, case.kv_indptr,
                                    case.kv_indices, case.custom_mask, case.mask_indptr, case.sm_scale,
                                    max_q_len=draft)
    torch.cuda.synchronize()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("stats", "verify"))
    ap.add_argument("size", help="stats: elements per output; verify: B,L,T,H")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("ncu_targets: needs a CUDA device")
    if args.what == "stats":
        if not args.size.isdigit() or int(args.size) < 1:
            raise SystemExit(f"stats: size must be a positive element count, got {args.size!r}")
        stats(int(args.size))
    else:
        parts = args.size.split(",")
        if len(parts) != 4 or not all(p.isdigit() for p in parts):
            raise SystemExit(f"verify: size must be B,L,T,H (four integers), got {args.size!r}")
        b, lp, t, h = (int(p) for p in parts)
        verify((b, lp, t, h))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
