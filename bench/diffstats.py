"""GPU benchmark of the fused diff statistics and the hook's per-call overhead (CUDA required).

Measures, with CUDA events (median of repeats):
* copy bandwidth (device-to-device copy of 1 GiB, read + write bytes);
* the fused diff pass (one launch) over two bf16 outputs of 64 MiB and 256 MiB each, timed as CUDA-graph
  replays of 4 back-to-back calls (a single eagerly launched call would time Python's launch instead):
  achieved bandwidth over the bytes of both outputs, as a fraction of the copy bandwidth (goal ≥ 70 %);
* the same pass per call under a CUDA graph on small outputs (goal ≤ max(4 µs, 2·bytes / copy bw)):
  a graph holding CALLS_PER_GRAPH calls (as a serving graph holds one per layer), replayed back to back,
  time / calls; the time of a one-call graph per replay (graph launch included) is printed beside it, and so
  are two simpler kernels over the same bytes: a D2D copy of them and a bare read on the same grid;
* a naive several-op torch diff pass on 256×64×512 for comparison;
* hook overhead per call: off and validate (eager, host time) and validate and on under a graph (device
  time, graph of baseline+candidate alone vs the whole shadowed call); ``--overhead-only`` measures just these.
Writes JSON (``--out``) and prints a markdown block; ``--results`` appends it to a results file.
``--latency-only`` measures just the per-call rows at the default tiles (with each kernel's registers and
spills; ``--tiles B,W,P ...`` adds those tiles, each with and without the histogram); with
``--shadowd-from DIR`` (a tree holding another revision's ``shadowd/``, e.g. from ``git archive REV shadowd``) it
measures that revision, so two revisions compare in one GPU session.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

# this repo's provenance helper first (labels this checkout, whatever --shadowd-from names); then shadowd from
# ``--shadowd-from DIR`` (read before the imports) or else from this repo
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.provenance import append_results, commit

if "--shadowd-from" in sys.argv:
    sys.path.insert(0, str(Path(sys.argv[sys.argv.index("--shadowd-from") + 1]).resolve()))

from shadowd.hook.config import HookConfig, Sampling
from shadowd.hook.device import REC, TILE, hist_mode_for, launch_stats, new_accumulator
from shadowd.hook.diffstats import raw_stats_torch
from shadowd.hook.runtime import HookRuntime
from shadowd.hook.site import Bucket, ShadowSite

CALLS_PER_GRAPH = 20
#: statistics kernel configurations tried on 2 × 64 MiB: ((elements per tile, warps, programs per SM), histogram
#: mode: 1 tl.histogram, 2 warp ballots, 3 shared-memory columns, 0 none)
VARIANTS = (((4096, 8, 2), 3), ((2048, 4, 4), 3), ((2048, 8, 2), 3), ((8192, 16, 1), 2), ((4096, 8, 2), 1),
            ((4096, 8, 2), 0))
#: configurations tried per call under a graph on the small outputs (latency, not bandwidth)
SMALL_VARIANTS = ((512, 4, 4), (1024, 4, 4), (1024, 2, 8), (2048, 4, 4), (4096, 4, 4), (4096, 4, 2), (4096, 8, 2),
                  (8192, 8, 2), (8192, 4, 2), (8192, 8, 1))
#: outputs timed per call under a graph: per-layer verify outputs [T·B, H, 512], 2^16 .. 2^25 elements (the
#: goal max(4 µs, 2·bytes / copy bw) turns from 4 µs to bandwidth at 2^21)
SHAPES = ((16, 8, 512), (64, 16, 512), (128, 16, 512), (128, 32, 512), (256, 32, 512), (256, 64, 512),
          (1024, 64, 512))
#: launch options tried per call under a graph on the small outputs (default tile): the first tile loaded
#: before the decision word (spec), programmatic dependent launch (pdl: each call's launch overlaps the
#: previous kernel), publish (the record's sequence number behind a system-scope fence, as the hook does), and the
#: fast pass's running state per element or per row (``launch_stats``' ``ew``), and the position of max |d| found by
#: re-reading its vector after the pass instead of tracked per element (``pos``)
LAUNCH_VARIANTS = {"spec": {"spec": True}, "pdl": {"pdl": True}, "spec+pdl": {"spec": True, "pdl": True},
                   "publish": {"publish": True}, "per-element state": {"ew": True},
                   "per-row state": {"ew": False}, "position by re-read": {"pos": False}}
HIST_NAMES = {0: "off", 1: "tl.histogram", 2: "warp ballots", 3: "shared-memory columns (red.shared)"}


def cuda_time(fn, reps: int = 20, warm: int = 3) -> float:
    """Median seconds of fn() by CUDA events."""
    for _ in range(warm):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


class Stats:
    """Preallocated scratch for standalone fused passes (as the hook keeps per site)."""

    def __init__(self) -> None:
        dev = torch.device("cuda")
        self.acc = new_accumulator(dev)
        self.rec = torch.zeros(4, REC, dtype=torch.float64, device=dev)
        self.seq = torch.zeros(4, dtype=torch.int64, device=dev)
        self.sstate = torch.zeros(16, dtype=torch.int64, device=dev)
        self.sstate[0] = 1
        self.dstate = torch.zeros(8, dtype=torch.int64, device=dev)

    def __call__(self, c: torch.Tensor, b: torch.Tensor, tile: tuple[int, int, int] | None = None,
                 hist: bool = True, hist_mode: int | None = None, **launch: bool) -> object:
        launch.setdefault("publish", False)
        return launch_stats(c, b, self.acc, self.rec, self.seq, self.sstate, self.dstate, tile=tile,
                            hist=hist, hist_mode=hist_mode, **launch)


def graph_time(fn, reps: int = 200) -> float:
    """Seconds per replay of a graph of fn(), timed over ``reps`` back-to-back replays."""
    return replay_time(make_graph(fn), reps)


def make_graph(fn) -> torch.cuda.CUDAGraph:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def replay_time(g: torch.cuda.CUDAGraph, reps: int = 200) -> float:
    def many() -> None:
        for _ in range(reps):
            g.replay()

    return cuda_time(many, reps=5, warm=1) / reps


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--results", default=None, help="markdown file to append to")
    ap.add_argument("--no-variants", action="store_true", help="skip the 2 × 64 MiB tile/histogram sweep")
    ap.add_argument("--latency-only", action="store_true",
                    help="only the per-call rows under a graph, at the default tiles")
    ap.add_argument("--overhead-only", action="store_true",
                    help="only the hook's overhead per call (host time, and device time under a graph)")
    ap.add_argument("--hist-modes", metavar="M", nargs="+", type=int, default=None,
                    help="with --tiles: also time each tile with these histogram modes (1 tl.histogram, 2 warp "
                         "ballots, 3 shared-memory columns: shadowd.hook.triton_hist)")
    ap.add_argument("--tiles", metavar="B,W,P", nargs="+", default=None,
                    help="with --latency-only: also time these tiles (elements per tile, warps, programs per SM) "
                         "per call under a graph, each with the histogram and without it")
    ap.add_argument("--launch-options", action="store_true",
                    help="with --latency-only: also time the launch options (LAUNCH_VARIANTS) up to 2^21 elements")
    ap.add_argument("--shadowd-from", metavar="DIR", default=None,
                    help="import shadowd from DIR (another revision's tree) instead of this repo")
    args = ap.parse_args()
    dev = torch.device("cuda")
    res: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
    res["commit"] = commit()
    res["triton"] = triton.__version__
    big = torch.empty(2**30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(big)
    t = cuda_time(lambda d=dst, s=big: d.copy_(s))
    copy_bw = 2 * big.numel() / t
    res["copy_bw_GBps"] = copy_bw / 1e9
    del big, dst
    if args.shadowd_from:
        res["commit"] += f" (shadowd from {args.shadowd_from})"
    if not args.overhead_only:
        stats_benchmarks(res, args, dev, copy_bw)
        if args.latency_only:
            return _emit(res, args)
    hook_overhead(res, dev)
    return _emit(res, args)


def stats_benchmarks(res: dict, args: argparse.Namespace, dev: torch.device, copy_bw: float) -> None:
    """The fused pass: bandwidth on large outputs, tile variants, per call under a graph on small ones."""
    st = Stats()
    res["fused"] = []
    res["variants"] = []
    for mib in () if args.latency_only else (64, 256):
        n = mib * 2**20 // 2
        b = torch.randn(n, device=dev, dtype=torch.bfloat16)
        c = b + (1e-2 * torch.randn(n, device=dev)).to(torch.bfloat16)
        t = graph_time(lambda c=c, b=b: [st(c, b) for _ in range(4)], reps=20) / 4
        bw = 2 * n * 2 / t
        res["fused"].append({"MiB_per_output": mib, "us": t * 1e6, "GBps": bw / 1e9, "frac_of_copy": bw / copy_bw,
                             "tile": list(TILE)})
        # tile configurations (elements per tile, warps, programs per SM), histogram on/off
        if mib == 64 and not args.no_variants:
            for tile, mode in VARIANTS:
                hist = mode != 0
                k = st(c, b, tile, hist, mode or None)
                tv = graph_time(lambda c=c, b=b, tile=tile, hist=hist, mode=mode: [st(c, b, tile, hist, mode)
                                                                                   for _ in range(4)], reps=20) / 4
                res["variants"].append({"tile": list(tile), "hist": hist, "hist_mode": hist_mode_for(mode, tile[1]),
                                        "us": tv * 1e6,
                                        "frac_of_copy": 2 * n * 2 / tv / copy_bw,
                                        "regs": getattr(k, "n_regs", None), "spills": getattr(k, "n_spills", None)})
        del b, c
    res["graph_small"] = []
    for shape in SHAPES:
        b = torch.randn(shape, device=dev, dtype=torch.bfloat16)
        c = b + (1e-2 * torch.randn(shape, device=dev)).to(torch.bfloat16)
        k = st(c, b)
        t = graph_time(lambda c=c, b=b: [st(c, b) for _ in range(CALLS_PER_GRAPH)]) / CALLS_PER_GRAPH
        t1 = graph_time(lambda c=c, b=b: st(c, b))
        st.sstate[0] = 0  # an unsampled call: the same launch, the decision word says no statistics
        t0 = graph_time(lambda c=c, b=b: [st(c, b) for _ in range(CALLS_PER_GRAPH)]) / CALLS_PER_GRAPH
        st.sstate[0] = 1
        nbytes = 2 * b.numel() * 2
        goal = max(4e-6, 2 * nbytes / copy_bw)
        refs = same_size_references(c, b)
        per_tile = {}
        if b.numel() <= 2**23 and not args.latency_only:
            for tile in SMALL_VARIANTS:
                per_tile[str(tile)] = 1e6 * graph_time(
                    lambda c=c, b=b, tile=tile: [st(c, b, tile) for _ in range(CALLS_PER_GRAPH)]) / CALLS_PER_GRAPH
        for tile in _tiles(args.tiles):
            for hist in (True, False):
                per_tile[f"{tile}{'' if hist else ' no histogram'}"] = 1e6 * graph_time(
                    lambda c=c, b=b, tile=tile, hist=hist: [st(c, b, tile, hist) for _ in range(CALLS_PER_GRAPH)]
                ) / CALLS_PER_GRAPH
            for mode in args.hist_modes or ():
                per_tile[f"{tile} histogram mode {hist_mode_for(mode, tile[1])}"] = 1e6 * graph_time(
                    lambda c=c, b=b, tile=tile, mode=mode: [st(c, b, tile, True, mode) for _ in range(CALLS_PER_GRAPH)]
                ) / CALLS_PER_GRAPH
        per_launch = {}
        if b.numel() <= 2**21 and (args.launch_options or not args.latency_only):
            for name, kw in LAUNCH_VARIANTS.items():
                try:
                    tv = graph_time(lambda c=c, b=b, kw=kw: [st(c, b, **kw) for _ in range(CALLS_PER_GRAPH)])
                    st.sstate[0] = 0
                    tu = graph_time(lambda c=c, b=b, kw=kw: [st(c, b, **kw) for _ in range(CALLS_PER_GRAPH)])
                    st.sstate[0] = 1
                    per_launch[name] = {"us": 1e6 * tv / CALLS_PER_GRAPH, "unsampled_us": 1e6 * tu / CALLS_PER_GRAPH}
                except Exception as e:  # a launch option this stack cannot do is reported, not fatal
                    st.sstate[0] = 1
                    per_launch[name] = {"error": f"{type(e).__name__}: {str(e)[:120]}"}
        res["graph_small"].append({"shape": list(shape), "bytes_both": nbytes, "us": t * 1e6, "goal_us": goal * 1e6,
                                   "meets_goal": t <= goal, "one_call_graph_us": t1 * 1e6,
                                   "unsampled_us": t0 * 1e6, "regs": getattr(k, "n_regs", None),
                                   "spills": getattr(k, "n_spills", None),
                                   "us_per_tile": per_tile, "us_per_launch_option": per_launch, **refs})
    if args.latency_only:
        return
    b = torch.randn(256, 64, 512, device=dev, dtype=torch.bfloat16)
    c = b + (1e-2 * torch.randn(256, 64, 512, device=dev)).to(torch.bfloat16)
    res["naive_torch_us_256x64x512"] = cuda_time(lambda: raw_stats_torch(c, b)) * 1e6


def _tiles(specs: list[str] | None) -> list[tuple[int, int, int]]:
    """``--tiles`` as (elements per tile, warps, programs per SM) tuples."""
    out = []
    for spec in specs or ():
        parts = spec.split(",")
        if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
            raise SystemExit(f"--tiles: {spec!r} is not B,W,P (three integers)")
        out.append((int(parts[0]), int(parts[1]), int(parts[2])))
    return out


def same_size_references(c: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    """What simpler kernels over the same bytes take per call of CALLS_PER_GRAPH in one graph: a device-to-device
    copy of both outputs' bytes (the yardstick the goal's 2·bytes / copy bw term models, at this size) and a
    read-only pass on the statistics kernel's tiles from 2^19 to 2^22 elements (one Σ(c − b) per program, nothing
    reduced across programs: what that pass costs with nothing to compute; an untuned loop above)."""
    src = torch.empty(2 * c.numel() * c.element_size(), dtype=torch.uint8, device=c.device)
    dst = torch.empty_like(src)
    out = torch.empty(READ_PROGRAMS, dtype=torch.float32, device=c.device)
    n = c.numel()
    copy_t = graph_time(lambda: [dst.copy_(src) for _ in range(CALLS_PER_GRAPH)]) / CALLS_PER_GRAPH
    # a copy captured in a graph is a memcpy node, which the driver may run on a copy engine: the same copy by a
    # kernel on the SMs beside it, so that the yardstick does not depend on that (on the H200 the two agree within
    # 1-17 % from 2^16 to 2^25 elements, bench/results/hook-2026-12-01.md, session 22)
    words, dsw = src.view(torch.int32), dst.view(torch.int32)
    sm_copy_t = graph_time(lambda: [_copy_kernel[(triton.cdiv(words.numel(), 4096),)](words, dsw, words.numel(),
                                                                                      BLOCK=4096, num_warps=4)
                                    for _ in range(CALLS_PER_GRAPH)]) / CALLS_PER_GRAPH
    read_t = graph_time(lambda: [_read_pass[(READ_PROGRAMS,)](c, b, out, n, BLOCK=4096, num_warps=4)
                                 for _ in range(CALLS_PER_GRAPH)]) / CALLS_PER_GRAPH
    return {"copy_same_bytes_us": copy_t * 1e6, "sm_copy_same_bytes_us": sm_copy_t * 1e6,
            "read_only_pass_us": read_t * 1e6}


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    # a plain device-to-device copy on the SMs (16-byte accesses): one block of words per program
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=m), mask=m)


READ_PROGRAMS = 264  # two per SM of an H200, as the statistics kernel's (4096, 4, 2) tiles up to 2^22 elements


@triton.jit
def _read_pass(c_ptr, b_ptr, out_ptr, n, BLOCK: tl.constexpr):
    # each program sums c − b over its grid-stride tiles and writes one float: the bytes are read once, with
    # no cross-program reduction, no histogram, no record
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(pid * BLOCK, n, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < n
        acc += tl.load(c_ptr + offs, mask=m, other=0.0).to(tl.float32) - tl.load(b_ptr + offs, mask=m,
                                                                                  other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


def hook_overhead(res: dict, dev: torch.device) -> None:
    """The hook's own cost per call: host time (off, eager validate) and device time under a graph (validate, its
    kill switch, on mode), around a small matmul baseline and candidate with the argument kinds of a verify site
    (bf16 activations and weights, int32 indices, an odd-length bool mask, int64 pointers: the candidate gets
    private copies of all five)."""
    x = torch.randn(64, 128, device=dev).to(torch.bfloat16)
    w = torch.randn(128, 256, device=dev).to(torch.bfloat16)
    idx = torch.randint(0, 1 << 20, (4096,), dtype=torch.int32, device=dev)
    mask = torch.rand(37, device=dev) < 0.5
    ptr = torch.arange(9, dtype=torch.int64, device=dev)
    args = (x, w, idx, mask, ptr)
    out0 = torch.empty(64, 256, device=dev, dtype=torch.bfloat16)

    def base(x: torch.Tensor, w: torch.Tensor, *_: torch.Tensor) -> torch.Tensor:
        return torch.matmul(x, w, out=out0)

    def cand(x: torch.Tensor, w: torch.Tensor, *_: torch.Tensor) -> torch.Tensor:
        return torch.matmul(x, w)

    def host_us(fn, n: int = 20000) -> float:
        for _ in range(100):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        return (t1 - t0) / n * 1e6

    off = ShadowSite("b", base, cand, runtime=HookRuntime(HookConfig(mode="off"), sink=lambda s: None))
    val = HookRuntime(HookConfig(mode="validate", sampling=Sampling(1)), sink=lambda s: None)
    vsite = ShadowSite("b", base, cand, runtime=val)
    valid = torch.tensor([64], dtype=torch.int32, device=dev)
    meta = torch.tensor([2, 16, 1000], dtype=torch.int64, device=dev)
    bucket = Bucket(batch_size=2, draft_tokens=16, prefix_len=1000, heads=8, valid_rows=valid, meta=meta)
    res["host_us_per_call"] = {
        "baseline_direct": host_us(lambda: base(*args)),
        "off": host_us(lambda: off(*args, layer=0)),
        "validate_eager_sampled": host_us(lambda: vsite(*args, layer=0, bucket=bucket), 5000),
    }
    val.device().poll()
    gv = make_graph(lambda: vsite(*args, layer=0, bucket=bucket))
    res["graph_us_per_call"] = {
        "baseline+candidate": graph_time(lambda: (base(*args), cand(*args))) * 1e6,
        "validate_shadowed": replay_time(gv) * 1e6,
    }
    val.device().poll()
    val.set_override("off")  # the same graph, statistics switched off by the kill switch
    torch.cuda.synchronize()  # (the control word reaches the device on a stream of its own)
    res["graph_us_per_call"]["validate_graph_kill_switch_off"] = replay_time(gv) * 1e6
    on = HookRuntime(HookConfig(mode="on", spot_every=100), sink=lambda s: None)
    osite = ShadowSite("b", base, cand, runtime=on)
    go = make_graph(lambda: osite(*args, layer=0, bucket=bucket))
    res["graph_us_per_call"]["on_shadowed"] = replay_time(go) * 1e6
    on.device().poll()
    if hasattr(on.device(), "push_coverage"):  # (trees before the verdict's shapes have no coverage to time)
        from shadowd.hook.coverage import Coverage

        # the same graph once a promotion gate opened on a verdict covering the call's shape: its control kernel
        # then checks the shape against the covered buckets (one more load)
        on.open_gate("bench", Coverage.from_buckets([[2, 16, 10]]))
        on.device().settle_control()
        res["graph_us_per_call"]["on_shadowed_gate_open"] = replay_time(go) * 1e6
        on.device().poll()


def _emit(res: dict, args: argparse.Namespace) -> int:
    txt = render(res)
    print(txt)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))
    append_results(args.results, txt)
    return 0


def render(r: dict) -> str:
    lines = [f"## bench/diffstats.py — {r['date']} — {r['gpu']} — commit {r['commit']} — torch {r['torch']}, "
             f"triton {r['triton']}", "", f"- copy bandwidth (1 GiB D2D, read+write): {r['copy_bw_GBps']:.0f} GB/s"]
    for f in r.get("fused", []):
        lines.append(f"- fused diff pass, 2 × {f['MiB_per_output']} MiB bf16: {f['us']:.1f} µs, "
                     f"{f['GBps']:.0f} GB/s = {100 * f['frac_of_copy']:.0f} % of copy (goal ≥ 70 %)")
    for v in r.get("variants", []):
        hist = HIST_NAMES[v["hist_mode"] if v["hist"] else 0]
        lines.append(f"  - variant tile {tuple(v['tile'])} histogram {hist}: {v['us']:.1f} µs = "
                     f"{100 * v['frac_of_copy']:.0f} % of copy ({v.get('regs')} registers, {v.get('spills')} spills)")
    for g in r.get("graph_small", []):
        lines.append(f"- under a graph, output {tuple(g['shape'])} bf16: {g['us']:.2f} µs per call of "
                     f"{CALLS_PER_GRAPH} in one graph (goal ≤ {g['goal_us']:.2f} µs: "
                     f"{'met' if g['meets_goal'] else 'NOT met'}); one-call graph {g['one_call_graph_us']:.2f} µs "
                     f"per replay; an unsampled call {g['unsampled_us']:.2f} µs ({g.get('regs')} registers, "
                     f"{g.get('spills')} spills)")
        if "copy_same_bytes_us" in g:
            sm_copy = (f" (by a copy kernel on the SMs {g['sm_copy_same_bytes_us']:.2f} µs)"
                       if "sm_copy_same_bytes_us" in g else "")
            lines.append(f"  - the same bytes per call of {CALLS_PER_GRAPH} in one graph: a D2D copy of them "
                         f"{g['copy_same_bytes_us']:.2f} µs{sm_copy}, a read-only pass {g['read_only_pass_us']:.2f} µs")
        if g.get("us_per_tile"):
            lines.append("  - per call by tile (elements, warps, programs per SM): "
                         + ", ".join(f"{k} {v:.2f} µs" for k, v in g["us_per_tile"].items()))
        if g.get("us_per_launch_option"):
            lines.append("  - per call by launch option (sampled / unsampled): " + ", ".join(
                f"{k} {v['us']:.2f} / {v['unsampled_us']:.2f} µs" if "us" in v else f"{k} {v['error']}"
                for k, v in g["us_per_launch_option"].items()))
    if "host_us_per_call" not in r:  # --latency-only
        return "\n".join(lines) + "\n"
    if "naive_torch_us_256x64x512" in r:
        lines.append(f"- naive torch diff pass (several ops) on 256×64×512: {r['naive_torch_us_256x64x512']:.0f} µs")
    h = r["host_us_per_call"]
    lines.append(f"- host time per call: baseline alone {h['baseline_direct']:.2f} µs, off {h['off']:.2f} µs "
                 f"(overhead {h['off'] - h['baseline_direct']:.2f} µs), validate sampled eager "
                 f"{h['validate_eager_sampled']:.1f} µs")
    g = r["graph_us_per_call"]
    lines.append(f"- device time per call under a graph: baseline+candidate {g['baseline+candidate']:.2f} µs, "
                 f"shadowed validate {g['validate_shadowed']:.2f} µs (overhead "
                 f"{g['validate_shadowed'] - g['baseline+candidate']:.2f} µs), kill switch off "
                 f"{g['validate_graph_kill_switch_off']:.2f} µs, on mode (spot check 1 in 100) "
                 f"{g['on_shadowed']:.2f} µs (overhead {g['on_shadowed'] - g['baseline+candidate']:.2f} µs)"
                 + (f", the same behind an open promotion gate (shapes checked) {g['on_shadowed_gate_open']:.2f} µs"
                    if "on_shadowed_gate_open" in g else ""))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
