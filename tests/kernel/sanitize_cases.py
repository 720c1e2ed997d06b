"""Small representative kernel launches for compute-sanitizer (memcheck/racecheck/initcheck/synccheck).

Run:  compute-sanitizer --tool memcheck python tests/kernel/sanitize_cases.py
Not a pytest module (no test_ prefix): it needs a GPU and is driven by bench/h200_kernel.sh.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import conftest  # noqa: F401
import mla_tree_verify
from mla_tree_verify import testing


def main() -> int:
    cases = [
        (testing.make_case([70, 0, 1], [5, 3, 1], 4, seed=1, device="cuda"), None),
        (testing.make_case([300], [17], 8, seed=2, device="cuda", use_mask=False), 3),
        (testing.make_case([33, 64], [40, 7], 2, seed=3, device="cuda", tree_kind="chain"), 4),
        (testing.make_case([0], [257], 1, seed=4, device="cuda", tree_kind="random"), 1),
    ]
    leaf_case = testing.make_case([40], [9], 3, seed=5, device="cuda", tree_kind="star")
    leaf_case.k_draft[8] = float("nan")
    cases.append((leaf_case, 2))
    wide_leaf = testing.make_case([40], [9], 8, seed=6, device="cuda", tree_kind="star")  # > 32 rows: two-group kernel
    wide_leaf.k_draft[8] = float("nan")
    cases.append((wide_leaf, 2))
    for case, splits in cases:
        total, H = case.q.shape[0], case.q.shape[1]
        out = torch.empty(total, H, 512, dtype=torch.bfloat16, device="cuda")
        lse = torch.empty(total, H, dtype=torch.float32, device="cuda")
        flag = torch.zeros(1, dtype=torch.int32, device="cuda")
        nonfinite = torch.zeros(1, dtype=torch.int32, device="cuda")
        mla_tree_verify.tree_verify(
            *case.args(), out=out, lse=lse, error_flag=flag, max_q_len=case.max_q_len, num_splits=splits,
            nonfinite_flag=nonfinite,
        )
        torch.cuda.synchronize()
        print(
            case.desc, "splits", splits, "flag", int(flag.item()), "finite", bool(torch.isfinite(out).all()),
            "nonfinite_flag", int(nonfinite.item()),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
