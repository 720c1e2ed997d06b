"""Benchmark: mla_tree_verify kernel vs SGLang's Triton extend_attention_fwd vs the roofline.

Usage (on a CUDA machine):  python bench/verify.py [--quick] [--out-dir DIR] [--no-append]

* roofline ceilings measured in the same run: device-to-device copy bandwidth (bytes read +
  written) and a register-only mma.sync m16n8k16 bf16 microkernel (nvcc-built, ctypes-loaded);
* per shape (B, L, T, H): random trees, scattered slots, FULL_MASK; inputs rotated over several
  copies of the KV buffer / q so the L2 does not flatter; both kernels timed as CUDA-graph replays
  (one graph = one call per rotated input set, as SGLang runs verify) with triton.testing.do_bench
  median (CUDA events);
* floor = max(bytes / copy_bw, FLOPs / mma_peak), bytes = sum 1152*(L+T) + 2176*T*H,
  FLOPs = sum 2*T*H*(L+T)*1088;
* prints a table and appends it (with date, GPU, commit and the sm_120 resource report) to
  bench/results/verify-<date>.md.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime as dt
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "kernel"))
sys.path.insert(0, str(ROOT))
import conftest  # noqa: E402,F401  (makes mla_tree_verify importable from the checkout)
import mla_tree_verify  # noqa: E402
from mla_tree_verify import compile_check, testing  # noqa: E402
from mla_tree_verify._build import find_nvcc  # noqa: E402

from bench.provenance import append_results, commit  # noqa: E402

SHAPES = [  # (B, L, T, H) - CONTEXT.md section 4, then our own
    (1, 4096, 8, 8),
    (1, 32768, 16, 8),
    (1, 131072, 16, 8),
    (16, 8192, 8, 8),
    (64, 4096, 8, 8),
    (1, 32768, 16, 64),
    (4, 32768, 64, 64),
    (1, 200000, 4, 8),
    (1, 200000, 16, 8),
    (2, 65536, 257, 16),
    (1, 32768, 257, 128),
]
QUICK = [(1, 4096, 8, 8), (1, 32768, 16, 8), (1, 32768, 16, 64), (4, 32768, 64, 64), (1, 200000, 4, 8)]

MMA_SRC = r"""
#include <stdint.h>
#include <cuda_runtime.h>
__global__ void mma_peak(float* out, int iters, uint32_t seed) {
  uint32_t a[4], b[2];
  for (int i = 0; i < 4; ++i) a[i] = 0x3F803F80u ^ ((seed + threadIdx.x * 7u + i) & 0x007F007Fu);
  b[0] = 0x3F003F00u ^ (threadIdx.x & 0x3Fu); b[1] = 0x3E803E80u;
  float acc[8][4];
  for (int k = 0; k < 8; ++k) for (int j = 0; j < 4; ++j) acc[k][j] = 0.f;
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int k = 0; k < 8; ++k)
      asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                   "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                   : "+f"(acc[k][0]), "+f"(acc[k][1]), "+f"(acc[k][2]), "+f"(acc[k][3])
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
  float s = 0.f;
  for (int k = 0; k < 8; ++k) for (int j = 0; j < 4; ++j) s += acc[k][j];
  if (s == 1234.5f) out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
extern "C" int launch_mma_peak(float* out, int blocks, int threads, int iters, void* stream) {
  mma_peak<<<blocks, threads, 0, (cudaStream_t)stream>>>(out, iters, 12345u);
  return (int)cudaGetLastError();
}
"""


def measure_copy_bw() -> float:
    n = 1 << 30  # 1 GiB each way
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    ts = []
    for _ in range(10):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        dst.copy_(src)
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e-3)
    ts.sort()
    del src, dst
    return 2 * n / ts[len(ts) // 2]


def measure_mma_peak() -> float:
    nvcc = find_nvcc()
    if nvcc is None:
        return float("nan")
    cap = torch.cuda.get_device_capability()
    arch = f"sm_{cap[0]}{cap[1]}"
    tmp = Path(tempfile.mkdtemp())
    (tmp / "mma.cu").write_text(MMA_SRC)
    so = tmp / "libmma.so"
    subprocess.run(
        [nvcc, "-O3", f"-arch={arch}", "-shared", "-Xcompiler", "-fPIC", "-o", str(so), str(tmp / "mma.cu")],
        check=True,
        capture_output=True,
    )
    lib = ctypes.CDLL(str(so))
    lib.launch_mma_peak.argtypes = [
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_void_p,
    ]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    blocks, threads, iters = sms * 8, 128, 4096
    out = torch.zeros(blocks * threads, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    best = 0.0
    for _ in range(6):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        rc = lib.launch_mma_peak(out.data_ptr(), blocks, threads, iters, stream)
        e1.record()
        torch.cuda.synchronize()
        assert rc == 0
        flops = blocks * (threads // 32) * iters * 8 * 2 * 16 * 8 * 16
        best = max(best, flops / (e0.elapsed_time(e1) * 1e-3))
    return best


def bench_ms(fn, rep_ms: float = 200.0) -> float:
    try:
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))
    except ImportError:
        for _ in range(3):
            fn()
        ts = []
        for _ in range(20):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            fn()
            e1.record()
            torch.cuda.synchronize()
            ts.append(e0.elapsed_time(e1))
        ts.sort()
        return ts[len(ts) // 2]


def graph_ms(fn, n: int, rep_ms: float = 200.0) -> float:
    """Median time of one call, timed as CUDA-graph replays of n calls (one per rotated input set),
    as SGLang runs target verify; this keeps Python launch overhead out of the kernel time."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(n):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            fn()
    torch.cuda.synchronize()
    return bench_ms(g.replay, rep_ms) / n


def roofline(B, L, T, H, bw, peak):
    nbytes = B * (1152 * (L + T) + 2176 * T * H)
    flops = B * 2 * T * H * (L + T) * 1088
    return nbytes, flops, max(nbytes / bw, flops / peak)


def run_shape(B, L, T, H, bw, peak, have_triton, seed=0):
    case = testing.make_case(
        [L] * B, [T] * B, H, seed=seed, device="cuda", tree_kind="random", extra_slots=1024
    )
    kv_bytes = case.kv_buffer.numel() * 2
    nsets = max(1, min(8, math.ceil(400e6 / max(kv_bytes, 1))))
    sets = [(case.q, case.kv_buffer)]
    for _ in range(nsets - 1):
        sets.append((case.q.clone(), case.kv_buffer.clone()))
    out = torch.empty(case.q.shape[0], H, 512, dtype=torch.bfloat16, device="cuda")
    total = case.q.shape[0]
    splits = mla_tree_verify.choose_num_splits(
        B, T, H, L + T, torch.cuda.get_device_properties(0).multi_processor_count,
        mla_tree_verify.block_m(),
    )
    ws = torch.empty(
        max(16, mla_tree_verify.workspace_size(B, total, H, splits)), dtype=torch.uint8, device="cuda"
    )
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    state = {"i": 0}

    def k_fn():
        q, kv = sets[state["i"] % nsets]
        state["i"] += 1
        mla_tree_verify.tree_verify(
            q,
            case.k_draft,
            kv,
            case.qo_indptr,
            case.kv_indptr,
            case.kv_indices,
            case.custom_mask,
            case.mask_indptr,
            case.sm_scale,
            out=out,
            workspace=ws,
            error_flag=flag,
            max_q_len=T,
            num_splits=splits,
        )

    k_fn()
    torch.cuda.synchronize()
    kern_out = out.clone()
    t_k = graph_ms(k_fn, nsets) * 1e3
    res = {"B": B, "L": L, "T": T, "H": H, "splits": splits, "kernel_us": t_k, "error_flag": int(flag.item())}
    nbytes, flops, floor = roofline(B, L, T, H, bw, peak)
    res.update(
        bytes=nbytes,
        flops=flops,
        floor_us=floor * 1e6,
        pct_floor=100 * floor * 1e6 / t_k,
        kernel_tflops=flops / (t_k * 1e-6) / 1e12,
        kernel_tbps=nbytes / (t_k * 1e-6) / 1e12,
    )
    if have_triton:
        tout = torch.empty_like(out)

        def t_fn():
            q, kv = sets[state["i"] % nsets]
            state["i"] += 1
            c2 = testing.Case(
                q,
                case.k_draft,
                kv,
                case.qo_indptr,
                case.kv_indptr,
                case.kv_indices,
                case.custom_mask,
                case.mask_indptr,
                case.sm_scale,
                case.prefix_lens,
                case.tree_sizes,
                None,
            )
            testing.run_sglang_triton(c2, tout)

        state["i"] = 0
        t_fn()
        torch.cuda.synchronize()
        state["i"] = 0
        k_fn()
        torch.cuda.synchronize()
        st = testing.error_stats(out, tout.double())
        res["vs_triton_cos_diff"] = st["cos_diff"]
        res["vs_triton_max_abs"] = st["max_abs"]
        est = t_k * 1e-3 * 300  # guess: Triton is ~100-300x slower; keep the timing short
        t_t = graph_ms(t_fn, nsets, rep_ms=min(2000.0, max(50.0, est))) * 1e3
        res["triton_us"] = t_t
        res["speedup"] = t_t / t_k
    del kern_out
    return res


def table(rows) -> str:
    lines = [
        "| B | L | T | H | splits | kernel µs | Triton µs | floor µs | % of floor | speed-up vs Triton | "
        "TFLOP/s | TB/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        tri = f"{r['triton_us']:.1f}" if "triton_us" in r else "-"
        sp = f"{r['speedup']:.1f}x" if "speedup" in r else "-"
        lines.append(
            f"| {r['B']} | {r['L']} | {r['T']} | {r['H']} | {r['splits']} | {r['kernel_us']:.1f} | {tri} | "
            f"{r['floor_us']:.1f} | {r['pct_floor']:.0f} % | {sp} | {r['kernel_tflops']:.0f} | "
            f"{r['kernel_tbps']:.2f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a subset of the shapes")
    ap.add_argument("--out-dir", default=os.environ.get("OUT"), help="also write JSON here")
    ap.add_argument("--no-append", action="store_true", help="do not append to bench/results")
    ap.add_argument("--no-triton", action="store_true")
    ap.add_argument("--shapes", help='explicit shapes "B,L,T,H;B,L,T,H"')
    ap.add_argument("--no-resources", action="store_true", help="skip the sm_120 resource report (A/B runs)")
    ns = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/verify.py needs a CUDA GPU", file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name(0)
    have_triton = (not ns.no_triton) and testing.sglang_triton_available()
    bw = measure_copy_bw()
    peak = measure_mma_peak()
    print(
        f"GPU {gpu}: copy {bw / 1e12:.2f} TB/s, mma.sync bf16 {peak / 1e12:.0f} TFLOP/s, "
        f"triton={have_triton}",
        flush=True,
    )
    rows = []
    shapes = QUICK if ns.quick else SHAPES
    if ns.shapes:
        shapes = [tuple(int(x) for x in sh.split(",")) for sh in ns.shapes.split(";")]
    for shape in shapes:
        try:
            r = run_shape(*shape, bw, peak, have_triton)
        except Exception as e:
            print(f"shape {shape}: FAILED {type(e).__name__}: {e}", flush=True)
            torch.cuda.empty_cache()
            continue
        rows.append(r)
        print(json.dumps(r), flush=True)
        torch.cuda.empty_cache()
    tab = table(rows)
    nvcc = find_nvcc()
    res_tab = ""
    if nvcc and not ns.no_resources:
        try:
            res_tab = compile_check.format_table(
                [x for x in compile_check.compile_reports(nvcc, ("120",)) if x.arch == "sm_120"]
            )
        except Exception as e:
            res_tab = f"(compile_check failed: {e})"
    date = dt.datetime.now(dt.UTC)
    triton_state = "yes" if have_triton else ("not run" if ns.no_triton else "not importable")
    md = (
        f"\n## {date:%Y-%m-%d %H:%M} UTC — {gpu}\n\ncommit: {commit()}; torch {torch.__version__}; "
        f"SGLang Triton baseline: {triton_state}\n\n"
        f"Ceilings measured in this run: copy {bw / 1e12:.2f} TB/s (read+write), register-only mma.sync "
        f"m16n8k16 bf16 {peak / 1e12:.0f} TFLOP/s.\n\n{tab}\n\nsm_120 build resources:\n\n{res_tab}\n"
    )
    print("\n" + tab)
    if ns.out_dir:
        Path(ns.out_dir).mkdir(parents=True, exist_ok=True)
        Path(ns.out_dir, "bench.json").write_text(
            json.dumps({"gpu": gpu, "copy_bw": bw, "mma_peak": peak, "rows": rows}, indent=1)
        )
        Path(ns.out_dir, "bench.md").write_text(md)
    if not ns.no_append:
        path = ROOT / "bench" / "results" / f"verify-{date:%Y-%m-%d}.md"
        if not path.exists():
            append_results(path, "# bench/verify.py results")
        append_results(path, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
