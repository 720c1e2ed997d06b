"""Builders of realistic runs and sample batches for tests and benchmarks."""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np

from shadowd.wire import COLUMNS, HIST_BINS, pack_column

__all__ = ["make_batch", "pack_columns", "run_body"]


def run_body(key: str | None = None, num_layers: int = 4, tp_size: int = 1, **over: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "run_key": key or f"run-{uuid.uuid4().hex[:12]}",
        "model": "kimi-k2.6",
        "num_layers": num_layers,
        "tp_size": tp_size,
        "gpu_name": "NVIDIA RTX PRO 6000 Blackwell",
        "gpu_arch": "sm_120",
        "driver": "580.159",
        "sglang_version": "0.5.23",
        "candidate": {"name": "kdtree-verify", "fingerprint": "build-abc123"},
        "baseline": {"name": "triton-extend", "fingerprint": "sglang-0.5.23"},
        "labels": {"team": "inference"},
    }
    body.update(over)
    return body


def make_batch(n: int, *, num_layers: int = 4, packed_hist: bool = False, packed: bool = False, seq: int = 0,
               producer: str = "p-test",
               rank: int = 0, step0: int = 0, ts0: float = 1.7e9, rel_l2: float = 3e-3, seed: int = 0,
               shapes: list[tuple[int, int, int, int]] | None = None, **columns: Any) -> dict[str, Any]:
    """A columnar batch of ``n`` in-tolerance samples: steps of ``num_layers`` calls each.

    ``shapes`` is a list of (batch_size, draft_tokens, prefix_len, heads) drawn per step.
    Any column can be overridden by passing a list (or a scalar, broadcast). ``packed_hist`` sends
    ``hist`` packed; ``packed`` sends every numeric column packed (what the hook's streamer sends).
    """
    rng = np.random.default_rng(seed)
    idx = np.arange(n)
    layer = idx % num_layers
    step = step0 + idx // num_layers
    shapes = shapes or [(1, 16, 32768, 8), (4, 8, 4096, 8), (16, 8, 8192, 8)]
    pick = rng.integers(0, len(shapes), size=int(step.max() - step0) + 1)[step - step0]
    shp = np.array(shapes)[pick]
    scale = 1.0
    rel = rel_l2 * rng.uniform(0.6, 1.4, size=n)
    hist = np.zeros((n, HIST_BINS), dtype=np.int64)
    numel = shp[:, 0] * shp[:, 1] * shp[:, 3] * 512
    hist[:, 20] = numel // 2
    hist[:, 21] = numel - numel // 2
    cols: dict[str, Any] = {
        "layer": layer.tolist(),
        "rank": [rank] * n,
        "step": step.tolist(),
        "call": idx.tolist(),
        "ts": (ts0 + step * 0.05).tolist(),
        "batch_size": shp[:, 0].tolist(),
        "draft_tokens": shp[:, 1].tolist(),
        "prefix_len": shp[:, 2].tolist(),
        "heads": shp[:, 3].tolist(),
        "numel": numel.tolist(),
        "max_abs": (rel * 4 * scale / 16).tolist(),
        "mean_abs": (rel * scale / 4).tolist(),
        "max_rel": (rel * 10).tolist(),
        "rel_l2": rel.tolist(),
        "cos_diff": (rel**2 / 2).tolist(),
        "out_scale": [scale] * n,
        "nan_base": [0] * n,
        "inf_base": [0] * n,
        "nan_cand": [0] * n,
        "inf_cand": [0] * n,
        "cand_nonfinite": [0] * n,
        "base_nonfinite": [0] * n,
        "hist": hist.tolist(),
        "new_requests": np.where(layer == 0, shp[:, 0], 0).tolist(),
    }
    if packed_hist:
        cols["hist"] = hist.astype("<i8").tobytes()
    for k, v in columns.items():
        cols[k] = v if isinstance(v, list) else [v] * n
    if packed:
        cols = pack_columns(cols)
    return {"producer": producer, "seq": seq, "samples": cols}


def pack_columns(cols: dict[str, Any]) -> dict[str, Any]:
    """The same columns with every numeric one packed (shadowd.wire's packed form)."""
    kinds = {c.name: c.kind for c in COLUMNS}
    out: dict[str, Any] = {}
    for k, v in cols.items():
        if k == "hist" and isinstance(v, list):
            out[k] = np.asarray(v, dtype="<i8").tobytes()
        elif kinds.get(k) in ("int", "float") and isinstance(v, list):
            out[k] = pack_column(kinds[k], v)  # type: ignore[arg-type]
        else:
            out[k] = v
    return out
