"""Representative launches for NVIDIA's compute-sanitizer: ``python -m mla_tree_verify.sanitize``.

A kernel that writes out of bounds, races in shared memory or reads memory nothing wrote cannot be contained by
whatever calls it: such faults are excluded *before* deployment, by running these launches under each of
compute-sanitizer's tools on the GPU the kernel will serve on (the machine code the tools check is that GPU's:
sm_120 on an RTX PRO 6000 Blackwell, sm_90 on an H100 / H200)::

    compute-sanitizer --tool memcheck --kernel-name kns=mtv_ python -m mla_tree_verify.sanitize

for ``memcheck``, ``racecheck`` and ``synccheck`` (``--kernel-name kns=mtv_`` instruments this library's kernels
only: torch's own allocation and read-back kernels are not under test), and ``initcheck`` without the filter: it
tracks which bytes were written, and is blind to the writes of kernels the filter leaves out (torch's, which make
these launches' inputs), so that filtered it reports every input read as uninitialized.

The launches cover all four forward instantiations (the 32-row ``<4>`` schedule and the 64-row ``<2>``, each
with the one-split and the split epilogue), every slice count of the combine (8, 4, 2, 1: fewer than 256,
256-511, 512-1023 and 1024 or more rows), prefix lengths 0 and 1, T = 257, a causal call without a mask, a chain
tree, and a NaN in a leaf's KV row (the only launch whose output must hold a non-finite value).

PyTorch's caching allocator is off in this process (``PYTORCH_NO_CUDA_MEMORY_CACHING=1``): every tensor is then an
allocation of its own to the tools, so a write past an output's end is caught instead of landing in the segment it
shares with its neighbours. One line per launch; exit status 0 when every launch ran and its output is finite
exactly where it must be, 1 otherwise, 2 without CUDA.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

__all__ = ["cases", "main"]


def cases(device: str = "cuda") -> list[tuple[Any, int, bool]]:
    """The launches: (case, num_splits, whether its output must be finite)."""
    from mla_tree_verify import testing

    out: list[tuple[Any, int, bool]] = [
        (testing.make_case([70, 0, 1], [5, 3, 1], 4, seed=1, device=device), 1, True),
        (testing.make_case([300], [17], 8, seed=2, device=device, use_mask=False), 3, True),
        (testing.make_case([33, 64], [40, 7], 2, seed=3, device=device, tree_kind="chain"), 4, True),
        (testing.make_case([0], [257], 1, seed=4, device=device, tree_kind="random"), 1, True),
        (testing.make_case([200], [4], 64, seed=7, device=device), 2, True),  # 256 rows: combine slices 4
        (testing.make_case([200], [8], 64, seed=8, device=device), 3, True),  # 512 rows: slices 2
        (testing.make_case([100], [16], 64, seed=9, device=device), 2, True),  # 1024 rows: slices 1
    ]
    for seed, heads in ((5, 3), (6, 8)):  # a NaN in a leaf's row: the <4> schedule, then the 64-row one
        leaf = testing.make_case([40], [9], heads, seed=seed, device=device, tree_kind="star")
        leaf.k_draft[8] = float("nan")
        out.append((leaf, 2, False))
    return out


def main() -> int:
    # Every tensor its own cudaMalloc: under PyTorch's caching allocator tensors share large segments, and a write
    # past one tensor's end into its neighbour would be a valid address to memcheck (and a read of a block freed and
    # reused would be initialised memory to initcheck). The allocator reads this at its first allocation.
    os.environ.setdefault("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")
    if not torch.cuda.is_available():
        print("mla_tree_verify.sanitize needs a CUDA GPU", file=sys.stderr)
        return 2
    import mla_tree_verify

    bad = 0
    for case, splits, finite in cases():
        total, heads = case.q.shape[0], case.q.shape[1]
        out = torch.empty(total, heads, 512, dtype=torch.bfloat16, device="cuda")
        lse = torch.empty(total, heads, dtype=torch.float32, device="cuda")
        flag = torch.zeros(1, dtype=torch.int32, device="cuda")
        nonfinite = torch.zeros(1, dtype=torch.int32, device="cuda")
        mla_tree_verify.tree_verify(*case.args(), out=out, lse=lse, error_flag=flag,
                                    max_q_len=case.max_q_len, num_splits=splits,
                                    nonfinite_flag=nonfinite)
        torch.cuda.synchronize()
        # every element of both outputs is read back: under initcheck, one the kernel left unwritten is a finding
        is_finite, err = bool(torch.isfinite(out).all()), int(flag.item())
        lse_finite = bool(torch.isfinite(lse).all())
        ok = err == 0 and (is_finite if finite else not is_finite)
        bad += not ok
        print(f"{'ok ' if ok else 'BAD'} {case.desc} splits {splits} error_flag {err} "
              f"finite {is_finite} nonfinite_flag {int(nonfinite.item())} lse finite {lse_finite}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
