"""Benchmark: host time per eager call of the kernel's Python entry, beside SGLang's Triton launcher.

Usage (on a CUDA machine):  python bench/verify_host.py [--from DIR] [--out-dir DIR] [--no-append]

An eager serving step (SGLang without CUDA graphs) pays, per layer, the host time of the attention call:
when it exceeds the call's device time the GPU waits for Python. Per shape this measures, in one run:

* ``tree_verify`` as the SGLang site calls it (no ``out`` / ``workspace``: both allocated per call);
* ``tree_verify`` with ``out`` and ``workspace`` passed (as under graph capture);
* the baseline: SGLang 0.5.23's Triton ``extend_attention_fwd`` with the same target-verify arguments
  (``mla_tree_verify.testing.run_sglang_triton``), whose launcher is what serving pays today.

Host µs per call = the least, over batches, of the wall time of N back-to-back calls / N (no synchronisation
inside a batch, which is shorter than the device queue). ``--from DIR`` imports ``mla_tree_verify`` from DIR/kernel
(another revision, for A/B runs in the same session). Appends a table with date, GPU and commit to
bench/results/verify-<date>.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if "--from" in sys.argv:  # read before the imports: mla_tree_verify comes from that tree
    _tree = Path(sys.argv[sys.argv.index("--from") + 1]).resolve()
    _pkg = Path(os.environ.get("TMPDIR", "/tmp")) / f"mtv-host-{os.getpid()}"
    _pkg.mkdir(exist_ok=True)
    if not (_pkg / "mla_tree_verify").exists():
        (_pkg / "mla_tree_verify").symlink_to(_tree / "kernel")
    sys.path.insert(0, str(_pkg))
sys.path.insert(0, str(ROOT / "tests" / "kernel"))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))
import conftest  # noqa: E402,F401  (makes mla_tree_verify importable from the checkout)
import mla_tree_verify  # noqa: E402
import torch  # noqa: E402
from mla_tree_verify import testing  # noqa: E402

from bench.provenance import append_results, commit  # noqa: E402

SHAPES = [(1, 4096, 8, 8), (1, 32768, 16, 8), (4, 8192, 64, 16)]
CALLS, BATCHES = 100, 30


def host_us(fn) -> float:
    """The least over BATCHES of (wall time of CALLS calls) / CALLS, in µs; the queue drains between batches. The
    least, not the median: the host's other work only ever adds time (the medians of one run spread ±30 %)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    per = []
    for _ in range(BATCHES):
        t0 = time.perf_counter()
        for _ in range(CALLS):
            fn()
        per.append((time.perf_counter() - t0) / CALLS * 1e6)
        torch.cuda.synchronize()
    return min(per)


def run_shape(B: int, L: int, T: int, H: int, have_triton: bool) -> dict:
    case = testing.make_case([L] * B, [T] * B, H, seed=0, device="cuda", tree_kind="random", extra_slots=64)
    args = (case.q, case.k_draft, case.kv_buffer, case.qo_indptr, case.kv_indptr, case.kv_indices,
            case.custom_mask, case.mask_indptr, case.sm_scale)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = mla_tree_verify.choose_num_splits(B, T, H, L + T, sms, mla_tree_verify.block_m())
    out = torch.empty(case.q.shape[0], H, 512, dtype=torch.bfloat16, device="cuda")
    ws = torch.empty(max(16, mla_tree_verify.workspace_size(B, case.q.shape[0], H, splits)), dtype=torch.uint8,
                     device="cuda")
    res = {"B": B, "L": L, "T": T, "H": H,
           "site_us": host_us(lambda: mla_tree_verify.tree_verify(*args, max_q_len=T)),
           "static_us": host_us(lambda: mla_tree_verify.tree_verify(*args, out=out, workspace=ws, max_q_len=T,
                                                                      num_splits=splits))}
    if have_triton:
        tout = torch.empty_like(out)
        res["triton_us"] = host_us(lambda: testing.run_sglang_triton(case, tout))
        res["site_vs_triton"] = res["site_us"] / res["triton_us"]
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--from", dest="tree", metavar="DIR", help="import mla_tree_verify from DIR/kernel")
    ap.add_argument("--out-dir", default=os.environ.get("OUT"), help="also write JSON here")
    ap.add_argument("--no-append", action="store_true", help="do not append to bench/results")
    args = ap.parse_args(argv)
    try:
        import sglang.kernels.ops.attention.extend_attention  # noqa: F401
        have_triton = True
    except Exception:
        have_triton = False
    rows = [run_shape(*s, have_triton) for s in SHAPES]
    head = (f"## {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC — {torch.cuda.get_device_name(0)} — host time "
            f"per eager call (bench/verify_host.py{' --from ' + args.tree if args.tree else ''})\n\n"
            f"commit: {commit()}; torch {torch.__version__}; "
            f"SGLang Triton baseline: {'yes' if have_triton else 'no'}\n")
    lines = [head, "| B | L | T | H | tree_verify as the site calls it µs | with out and workspace µs | Triton µs "
             "| site / Triton |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tri = f"{r['triton_us']:.1f} | {r['site_vs_triton']:.2f}" if "triton_us" in r else "— | —"
        lines.append(f"| {r['B']} | {r['L']} | {r['T']} | {r['H']} | {r['site_us']:.1f} | {r['static_us']:.1f} "
                     f"| {tri} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out_dir:
        Path(args.out_dir, "verify_host.json").write_text(json.dumps(rows, indent=2))
    if not args.no_append:
        res = ROOT / "bench" / "results" / f"verify-{dt.date.today():%Y-%m-%d}.md"
        append_results(res, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
