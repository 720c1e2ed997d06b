"""CPU benchmark of the hook's per-call cost on the serving thread (goal: off-mode overhead < 2 µs).

Measures (best of 5 repeats, per call):
* the baseline called directly vs through ``ShadowSite`` in ``off`` mode — the off-mode overhead;
* validate mode on an unsampled step (the sampling decision only);
* on mode on an unchecked step (the candidate's output checked on its own, without the baseline);
* the enqueue cost: ``Streamer.submit`` of one sample (``put_nowait``), sender thread running;
* a full validate call on tiny tensors (statistics on the calling thread, CPU path).

``--cuda`` (on a GPU machine) adds the same per-call rows with CUDA tensors: the host time the serving thread
spends in the hook on an eager call (off; validate unsampled; on between spot checks — the candidate served, its
output's type and meta checked without reading values). The implementations return a preallocated tensor and
launch nothing, so the rows are the hook's own host cost.
Appends a markdown block to ``bench/results/hook-<date>.md`` (``--no-write`` to skip).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.provenance import append_results, commit
from shadowd.client import CollectorClient
from shadowd.hook.config import HookConfig, Sampling
from shadowd.hook.runtime import HookRuntime
from shadowd.hook.site import ShadowSite
from shadowd.hook.spool import Spool
from shadowd.hook.streamer import Streamer


def cpu_header(script: str) -> tuple[str, datetime.datetime]:
    """A CPU bench's results heading (script, UTC time, CPU, Python, torch, commit) and that time."""
    now = datetime.datetime.now(datetime.UTC)
    return (f"## bench/{script} — {now:%Y-%m-%d %H:%M} UTC — {platform.processor() or platform.machine()}, "
            f"{os.cpu_count()} CPUs, Python {platform.python_version()}, torch {torch.__version__} — "
            f"commit {commit()}\n\n"), now


def append_dated(subject: str, now: datetime.datetime, text: str) -> None:
    """Append ``text`` to ``bench/results/<subject>-<date>.md`` (the date of ``now``) and say where."""
    path = Path(__file__).parent / "results" / f"{subject}-{now:%Y-%m-%d}.md"
    append_results(path, text)
    print(f"appended to {path}")


def per_call(fn, n: int) -> float:
    """Best-of-5 seconds per call of fn() over n calls."""
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return best


def cuda_rows() -> str:
    """The eager per-call host cost with CUDA tensors (see the module docstring)."""
    if not torch.cuda.is_available():
        return "- --cuda: no CUDA device here, rows skipped\n"
    dev = torch.device("cuda")
    x = torch.zeros(4, 512, device=dev, dtype=torch.bfloat16)
    out = torch.zeros(4, 512, device=dev, dtype=torch.bfloat16)

    def impl(x: torch.Tensor) -> torch.Tensor:
        return out

    def site(mode: str, **cfg: int) -> ShadowSite:
        return ShadowSite("c", impl, impl, runtime=HookRuntime(HookConfig(mode=mode, **cfg), sink=lambda s: None))

    off = site("off")
    unsampled = ShadowSite("c", impl, impl, runtime=HookRuntime(
        HookConfig(mode="validate", sampling=Sampling(10**9)), sink=lambda s: None))
    unchecked = site("on", spot_every=10**9)
    for s in (off, unsampled, unchecked):  # first calls: device state, kernels compiled, the output key learnt
        for _ in range(3):
            s(x, layer=0)
    torch.cuda.synchronize()
    n = 20_000
    direct = per_call(lambda: impl(x), n)
    rows = {name: per_call(lambda s=s: s(x, layer=0), n) for name, s in
            (("off", off), ("validate, unsampled", unsampled), ("on, unchecked", unchecked))}
    torch.cuda.synchronize()
    md = f"- CUDA tensors ({torch.cuda.get_device_name()}), eager, host time per call on the serving thread:\n"
    md += f"  - implementation called directly: {direct * 1e6:.3f} µs\n"
    for name, t in rows.items():
        md += f"  - {name}: {t * 1e6:.3f} µs (overhead {(t - direct) * 1e6:.3f} µs)\n"
    return md


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--cuda", action="store_true", help="also the eager per-call host cost with CUDA tensors")
    args = ap.parse_args()
    torch.set_num_threads(1)
    x = torch.zeros(4, 4)
    out = torch.zeros(4, 4)

    def base(x: torch.Tensor) -> torch.Tensor:
        return out

    def cand(x: torch.Tensor) -> torch.Tensor:
        return out

    off = ShadowSite("b", base, cand, runtime=HookRuntime(HookConfig(mode="off"), sink=lambda s: None))
    unsampled = ShadowSite("b", base, cand, runtime=HookRuntime(
        HookConfig(mode="validate", sampling=Sampling(10**9)), sink=lambda s: None))
    n = 200_000
    direct = per_call(lambda: base(x), n)
    off_t = per_call(lambda: off(x, layer=0), n)
    uns_t = per_call(lambda: unsampled(x, layer=0), n)
    # on mode between spot checks: the candidate served, its output checked on its own (the CPU path: inputs'
    # version counters, type, dtype / shape against the baseline's, NaN / Inf in the real rows)
    unchecked = ShadowSite("b", base, cand, runtime=HookRuntime(
        HookConfig(mode="on", spot_every=10**9), sink=lambda s: None))
    on_t = per_call(lambda: unchecked(x, layer=0), n // 4)
    with tempfile.TemporaryDirectory() as tmp:
        client = CollectorClient("http://127.0.0.1:9", timeout=0.5)  # nothing listens: everything spools
        st = Streamer(client, 1, Spool(Path(tmp), 2**20), queue_max=10**7).start()
        sample = dict.fromkeys(("layer", "rank", "step", "call", "batch_size", "draft_tokens", "prefix_len",
                                "heads", "numel", "nan_base", "inf_base", "nan_cand", "inf_cand",
                                "cand_nonfinite", "base_nonfinite"), 1)
        sample.update(dict.fromkeys(("ts", "max_abs", "mean_abs", "max_rel", "rel_l2", "cos_diff", "out_scale"), 0.0))
        sample["hist"] = [0] * 40
        enq = per_call(lambda: st.submit(sample), 100_000)
        st._stop.set()
    full_rt = HookRuntime(HookConfig(mode="validate", sampling=Sampling(1)), sink=lambda s: None)
    xs = torch.randn(16, 64).to(torch.bfloat16)
    full = ShadowSite("b", lambda a: a * 2, lambda a: a + a, runtime=full_rt)
    full_t = per_call(lambda: full(xs, layer=0), 2000)
    head, now = cpu_header("hook_overhead.py")
    md = (head + f"- baseline called directly: {direct * 1e6:.3f} µs per call\n"
          f"- through ShadowSite, mode off: {off_t * 1e6:.3f} µs → off-mode overhead "
          f"{(off_t - direct) * 1e6:.3f} µs per call (goal < 2 µs)\n"
          f"- validate, unsampled step: {uns_t * 1e6:.3f} µs (overhead {(uns_t - direct) * 1e6:.3f} µs)\n"
          f"- on, an unchecked step (candidate served, its output checked on its own): {on_t * 1e6:.3f} µs "
          f"(overhead {(on_t - direct) * 1e6:.3f} µs)\n"
          f"- enqueue (Streamer.submit, put_nowait) with the sender running: {enq * 1e6:.3f} µs per sample\n"
          f"- full validate call, 16×64 bf16, statistics on the CPU: {full_t * 1e6:.1f} µs per call\n")
    if args.cuda:
        md += cuda_rows()
    print(md)
    if not args.no_write:
        append_dated("hook", now, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
