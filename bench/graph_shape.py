"""Benchmark: the SGLang site's per-forward shape tensor under a CUDA graph, one Triton kernel against torch ops.

Usage (on a CUDA machine):  python bench/graph_shape.py [--results FILE]

``shadowd.sglang.padding.graph_shape`` (real requests, longest real prefix and real token rows of a padded graph
replay) is captured into SGLang's decode graph once per forward, so it runs on every replay. Per captured batch
(requests × draft tokens, half the rows padding), 50 calls are captured into one graph and the graph replayed 20
times; the figure is the median replay's time per call, for the torch operations (``graph_shape_torch``, the CPU
path and reference; some fifteen kernels) and for the fused kernel (``shadowd.sglang.triton_padding``) in the same
run. Both results are checked equal first.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.provenance import append_results, commit
from shadowd.sglang.padding import graph_shape_torch
from shadowd.sglang.triton_padding import graph_shape_fused

#: (requests, draft tokens per request) of the captured batches
BATCHES = ((1, 8), (4, 64), (16, 16), (64, 8), (256, 4))
CALLS, REPLAYS = 50, 20


def per_call_us(fn: Callable[..., torch.Tensor], args: tuple[Any, ...]) -> float:
    fn(*args)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn(*args)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPLAYS):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / CALLS)
    return sorted(times)[REPLAYS // 2]


def measure() -> list[tuple[int, int, float, float]]:
    rows_out = []
    for bs, draft in BATCHES:
        rows = bs * draft
        qo = torch.arange(0, (bs + 1) * draft, draft, dtype=torch.int32, device="cuda")
        kv = torch.cumsum(torch.randint(1, 40000, (bs + 1,), device="cuda"), 0).to(torch.int32)
        loc = torch.randint(1, 10**6, (rows,), device="cuda")
        loc[rows // 2:] = 0  # the padded half
        args = (qo, kv, loc, bs, draft, rows)
        if graph_shape_fused(*args).tolist() != graph_shape_torch(*args).tolist():
            raise SystemExit(f"graph_shape: the fused kernel and the torch ops differ at {bs}x{draft}")
        rows_out.append((bs, draft, per_call_us(graph_shape_torch, args), per_call_us(graph_shape_fused, args)))
    return rows_out


def render(results: list[tuple[int, int, float, float]], gpu: str, commit: str) -> str:
    lines = [f"## bench/graph_shape.py — {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC — {gpu} — commit {commit} — "
             f"torch {torch.__version__}", "",
             "| requests × drafts | torch ops, µs per call | fused kernel, µs per call | ratio |", "|---|---|---|---|"]
    lines += [f"| {bs} × {d} | {t:.2f} | {f:.2f} | {t / f:.1f}× |" for bs, d, t, f in results]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=None, help="markdown file to append the table to")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("graph_shape: needs a CUDA device")
    txt = render(measure(), torch.cuda.get_device_name(), commit())
    print(txt)
    append_results(args.results, txt)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
