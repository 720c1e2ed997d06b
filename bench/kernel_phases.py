"""Where one tree_verify call's time goes, from a timing build of the kernel (CUDA required).

Usage (on a CUDA machine):  python bench/kernel_phases.py [--shapes "B,L,T,H;..."] [--out FILE]

Builds the library with ``-DMTV_TIMING`` for this GPU only (cached apart from the normal build): every
forward CTA stamps the global timer at entry, before and after its KV loop and at exit, every combine CTA
at entry and exit, and warps 0 and 5 of CTA 0 stamp the SM clock at each phase of their first 64 KV tiles.
Prints per shape: the graph-replay time of the timing build, CTA setup / loop / epilogue (min, median,
max), the gap between the forward kernel's last exit and the combine's first entry (negative: the combine,
a programmatic dependent launch, started before it), the combine's span, and the median cycles per phase of
a KV tile for both warps; the last phase is two back-to-back stamps, i.e. what one stamp costs. Read the
numbers as proportions: the timing build is not the shipped one.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests" / "kernel"))
import conftest  # noqa: E402,F401  (makes mla_tree_verify importable from the checkout)

# the stamps of tree_verify_fwd.cuh's loop, in order (the next tile's cp.async go out after the S barrier)
PHASES = ("wait+barrier", "row-address ring", "flag reset", "S", "S barrier + cp.async issue", "softmax+P",
          "pre-PV barrier", "P.V", "one stamp")
SHAPES = ((1, 200000, 4, 8), (1, 32768, 16, 8), (16, 8192, 8, 8), (4, 32768, 64, 64))


def timing_library() -> Path:
    os.environ["MLA_TREE_VERIFY_NVCC_FLAGS"] = (os.environ.get("MLA_TREE_VERIFY_NVCC_FLAGS", "") + " -DMTV_TIMING")
    from mla_tree_verify._build import build

    major, minor = torch.cuda.get_device_capability()
    lib = build((f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}",))
    os.environ["MLA_TREE_VERIFY_LIB"] = str(lib)
    return lib


def pct(x: np.ndarray) -> list[float]:
    return [round(float(v), 2) for v in np.percentile(x, [0, 50, 100])]


def run_shape(B: int, L: int, T: int, H: int) -> dict:
    import mla_tree_verify
    import verify
    from mla_tree_verify import _lib, testing

    case = testing.make_case([L] * B, [T] * B, H, seed=0, device="cuda", tree_kind="random", extra_slots=1024)
    out = torch.empty(case.q.shape[0], H, 512, dtype=torch.bfloat16, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = mla_tree_verify.choose_num_splits(B, T, H, L + T, sms, mla_tree_verify.block_m())
    ws = torch.empty(max(16, mla_tree_verify.workspace_size(B, case.q.shape[0], H, splits)), dtype=torch.uint8,
                     device="cuda")

    def call() -> None:
        mla_tree_verify.tree_verify(*case.args(), out=out, workspace=ws, max_q_len=T, num_splits=splits)

    graph_us = verify.graph_ms(call, 4, 100.0) * 1e3
    lib = _lib.load()
    torch.cuda.synchronize()
    if lib.mtv_clear_timing() != 0:  # no stamp of an earlier shape survives into this one's
        raise RuntimeError("mtv_clear_timing failed")
    call()
    torch.cuda.synchronize()
    cta = np.zeros((2048, 4), dtype=np.uint64)
    it = np.zeros((2, 64, 10), dtype=np.int64)
    comb = np.zeros((4096, 2), dtype=np.uint64)
    for arr, which in ((cta, 0), (it, 1), (comb, 2)):
        rc = lib.mtv_read_timing(arr.ctypes.data_as(ctypes.c_void_p), which)
        if rc != 0:
            raise RuntimeError(f"mtv_read_timing({which}) failed: {rc}")
    c = cta.astype(np.int64)
    c = c[c[:, 3] > 0]
    t0 = c[:, 0].min()
    rel = (c - t0) / 1e3
    res: dict = {"shape": [B, L, T, H], "splits": splits, "graph_us": round(graph_us, 1), "ctas": len(c),
                 "setup_us": pct(rel[:, 1] - rel[:, 0]), "loop_us": pct(rel[:, 2] - rel[:, 1]),
                 "epilogue_us": pct(rel[:, 3] - rel[:, 2]), "fwd_span_us": round(float(rel[:, 3].max()), 2)}
    cc = comb[: min(case.q.shape[0] * H, 4096)].astype(np.int64)
    cc = cc[cc[:, 1] > 0]
    if splits > 1 and len(cc):
        res["combine_gap_us"] = round(float((cc[:, 0].min() - t0) / 1e3 - rel[:, 3].max()), 2)
        res["combine_span_us"] = round(float((cc[:, 1].max() - cc[:, 0].min()) / 1e3), 2)
    per_split = math.ceil((L + T) / splits)  # KV rows of CTA 0's split (a multiple of 32 on the device)
    tiles = min(64, math.ceil(per_split / 32))
    if tiles > 2:
        for w, name in ((0, "warp0"), (1, "warp5")):
            d = np.diff(it[w, :tiles], axis=1)[1 : tiles - 1]
            res[name + "_cycles"] = {p: int(np.median(d[:, k])) for k, p in enumerate(PHASES)}
            res[name + "_tile_cycles"] = int(np.median(np.diff(it[w, :tiles, 0])[1:]))
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", help='"B,L,T,H;B,L,T,H"')
    ap.add_argument("--out", help="write the JSON here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("kernel_phases: needs a CUDA GPU", file=sys.stderr)
        return 2
    shapes = ([tuple(int(x) for x in s.split(",")) for s in args.shapes.split(";")] if args.shapes else SHAPES)
    print("timing build:", timing_library())
    results = []
    for shape in shapes:
        r = run_shape(*shape)
        results.append(r)
        print(json.dumps(r), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
