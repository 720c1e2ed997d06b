"""Benchmark: what the verify kernel's KV access pattern can read per second, beside the copy bandwidth.

Usage (on a CUDA machine):  python bench/kv_gather.py [--rows 200000] [--results FILE]

The roofline floor of ``bench/verify.py`` divides the KV bytes by the device-to-device *copy* bandwidth
(sequential, read + write). The verify kernel reads something else: L rows of 1152 bytes (one 576-wide bf16
latent row each) at *scattered* slots, one slot per row (``mla_tree_verify.testing``'s layout: a random
permutation of the KV buffer's slots), split into one contiguous run of rows per CTA. This script measures a
read-only Triton gather of exactly that pattern — each program sums its run of rows, 32 or 64 rows per step, and
writes one float — with consecutive slots and with scattered ones, at several grid sizes and step sizes, so
that the kernel's memory-bound figures can be read against what the access pattern allows, not only against a
sequential copy. Every time is the median of CUDA-graph replays (``triton.testing.do_bench``) over KV buffers
rotated so that the L2 does not hold the rows a call reads; each sum is checked against torch.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.provenance import append_results, commit

ROW = 576  # bf16 elements per latent KV row (1152 bytes)
ROW_C = tl.constexpr(ROW)  # (kernels may only read constexpr globals)
#: (programs per SM, warps, rows per step) tried for each slot order: one program per SM, as the verify kernel runs
#: on sm_120's budget, with one or two of its 32-row tiles (36.9 KB each) in flight; then more programs per SM
GRIDS = ((1, 8, 32), (1, 8, 64), (1, 16, 64), (2, 8, 32), (4, 4, 32))
ROTATE = 3  # KV buffers the calls rotate over


@triton.jit
def _gather_sum(kv_ptr, idx_ptr, out_ptr, rows, per_prog, ROWS: tl.constexpr, INDEXED: tl.constexpr):
    # program p sums rows [p·per_prog, (p+1)·per_prog) of the KV buffer, ROWS at a time: the 512-column part and
    # the 64-column part of each row (one 1152-byte row = 9 lines of 128 bytes), through the slot indices when
    # INDEXED, else at consecutive slots
    pid = tl.program_id(0)
    start = pid * per_prog
    end = tl.minimum(start + per_prog, rows)
    c512 = tl.arange(0, 512)
    c64 = tl.arange(0, 64)
    acc = tl.zeros([ROWS, 512], tl.float32)
    acc64 = tl.zeros([ROWS, 64], tl.float32)
    for r0 in range(start, end, ROWS):
        r = r0 + tl.arange(0, ROWS)
        m = r < end
        if INDEXED:  # noqa: SIM108 - a constexpr branch in a Triton kernel
            slot = tl.load(idx_ptr + r, mask=m, other=0).to(tl.int64)
        else:
            slot = r.to(tl.int64) + 1
        base = kv_ptr + slot[:, None] * ROW_C
        acc += tl.load(base + c512[None, :], mask=m[:, None], other=0.0).to(tl.float32)
        acc64 += tl.load(base + 512 + c64[None, :], mask=m[:, None], other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, axis=1).sum(axis=0) + tl.sum(acc64, axis=1).sum(axis=0))


def copy_bandwidth() -> float:
    """Bytes read + written per second by a 1 GiB device-to-device copy, launched eagerly and timed with events
    (median), as ``bench/verify.py`` and ``bench/diffstats.py`` measure it (the same copy timed by
    ``triton.testing.do_bench_cudagraph`` read 2.8 TB/s on the H200 against 4.2 eagerly; the cause was not
    established, and ``bench/diffstats.py``'s 20-call graphs of smaller copies read ~4 TB/s)."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = triton.testing.do_bench(lambda: dst.copy_(src), rep=200, return_mode="median")
    return 2 * src.numel() / (t * 1e-3)


def measure(rows: int, seed: int = 0) -> dict:
    """Achieved read bandwidth of the gather per (slot order, grid), with the copy bandwidth of the same run."""
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    gen = torch.Generator().manual_seed(seed)
    slots = rows + 1 + 1024  # slot 0 is SGLang's dummy; the buffer holds more slots than the call reads
    kvs = [torch.randn(slots, ROW, generator=gen).to(torch.bfloat16).to(dev) for _ in range(ROTATE)]
    orders = {"consecutive": torch.arange(1, rows + 1),
              "scattered": torch.randperm(slots - 1, generator=gen)[:rows] + 1}
    res: dict = {"rows": rows, "kv_MB": rows * ROW * 2 / 1e6, "copy_GBps": copy_bandwidth() / 1e9, "runs": []}
    for name, idx_cpu in orders.items():
        idx = idx_cpu.to(torch.int64).to(dev)
        want = [float(kv.float()[idx_cpu.to(dev)].sum()) for kv in kvs]
        for per_sm, warps, step in GRIDS:
            nprog = per_sm * sms
            per_prog = triton.cdiv(rows, nprog)
            outs = [torch.empty(nprog, dtype=torch.float32, device=dev) for _ in kvs]

            def call(i: int, idx: torch.Tensor = idx, outs: list = outs, nprog: int = nprog,
                     per_prog: int = per_prog, warps: int = warps, step: int = step, name: str = name) -> None:
                _gather_sum[(nprog,)](kvs[i], idx, outs[i], rows, per_prog, ROWS=step, INDEXED=name == "scattered",
                                      num_warps=warps)

            for i in range(ROTATE):
                call(i)
            torch.cuda.synchronize()
            for i, kv_want in enumerate(want):  # the sum over the rows read, against torch's
                got = float(outs[i].double().sum())
                if abs(got - kv_want) > 1e-3 * max(1.0, abs(kv_want)) + 1e-2 * rows ** 0.5:
                    raise SystemExit(f"gather {name} {per_sm, warps, step}: sum {got} != torch's {kv_want}")
            t = triton.testing.do_bench_cudagraph(lambda: [call(i) for i in range(ROTATE)], rep=200,
                                                  return_mode="median") / ROTATE
            gbps = rows * ROW * 2 / (t * 1e-3) / 1e9
            res["runs"].append({"slots": name, "programs_per_sm": per_sm, "warps": warps, "rows_per_step": step,
                                "us": t * 1e3, "GBps": gbps, "frac_of_copy": gbps / res["copy_GBps"]})
    return res


def render(res: dict, gpu: str, commit: str) -> str:
    lines = [f"## bench/kv_gather.py — {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC — {gpu} — commit {commit} — "
             f"torch {torch.__version__}, triton {triton.__version__}", "",
             f"Read-only gather of {res['rows']} KV rows of 1152 B ({res['kv_MB']:.0f} MB) per call; copy bandwidth "
             f"{res['copy_GBps']:.0f} GB/s (1 GiB D2D, read + write).", "",
             "| slots | programs per SM | warps | rows per step | µs per call | GB/s read | of copy bandwidth |",
             "|---|---|---|---|---|---|---|"]
    for r in res["runs"]:
        lines.append(f"| {r['slots']} | {r['programs_per_sm']} | {r['warps']} | {r['rows_per_step']} | {r['us']:.1f} | "
                     f"{r['GBps']:.0f} | {100 * r['frac_of_copy']:.0f} % |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=200000, help="KV rows per call (default 200000: 230 MB)")
    ap.add_argument("--results", type=Path, default=None, help="markdown file to append the table to")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("kv_gather: needs a CUDA device")
    if args.rows < 1:
        raise SystemExit("--rows must be at least 1")
    txt = render(measure(args.rows), torch.cuda.get_device_name(), commit())
    print(txt)
    append_results(args.results, txt)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
