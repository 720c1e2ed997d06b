"""Constructed rollups for judge unit tests (no database)."""

from __future__ import annotations

from typing import Any

from shadowd.judge.inputs import RunRollups, StepCounts
from shadowd.judge.policy import Policy

#: a small policy so constructed runs reach READY with few numbers
SMALL = Policy(target_rate=0.01, confidence=0.99, min_requests=10, min_span_s=60.0, min_cell_samples=10,
               drift_window_s=100.0, drift_ratio=2.0, drift_min_samples=20, hysteresis_k=1,
               hysteresis_minutes=0.0)
T0 = 1_800_000_000.0
BUCKET = (4, 8, 13, 8)


def cell(layer: int, n: float, rel: float = 3e-3, bucket: tuple[int, int, int, int] = BUCKET,
         **over: Any) -> dict[str, Any]:
    """A (layer, bucket) cell of ``n`` calls with mean rel-L2 ``rel`` (cos = rel²/2, scaled = rel)."""
    row: dict[str, Any] = {
        "layer": layer, "bs_bucket": bucket[0], "t_bucket": bucket[1], "prefix_bucket": bucket[2],
        "heads": bucket[3], "n": n, "n_exceed": 0, "n_error": 0, "n_cand_nonfinite": 0, "n_base_nonfinite": 0,
        "n_nan_stat": 0, "n_nan_unexplained": 0, "numel": n * 1000, "n_oracle": 0, "n_timed": 0,
        "sum_max_abs": n * rel, "sum_rel_l2": n * rel, "sum_cos_diff": n * rel * rel / 2, "sum_scaled": n * rel,
        "sum_cand_us": 0.0, "sum_base_us": 0.0, "max_max_abs": rel, "max_rel_l2": rel,
        "max_cos_diff": rel * rel / 2, "max_max_rel": rel, "max_scaled": rel, "max_oracle_cand": 0.0,
        "max_oracle_base": 0.0, "max_oracle_ratio": 0.0, "first_ts": T0, "last_ts": T0 + 600,
    }
    row.update(over)
    return row


def slot(layer: int, t: float, n: float, rel: float = 3e-3) -> dict[str, Any]:
    row = cell(layer, n, rel)
    row["t"] = t
    return row


def rollups(num_layers: int = 2, n_per_layer: int = 1000, steps: int = 2000, exceeded: int = 0,
            requests: int = 100, span: float = 600.0, rel: float = 3e-3, recent_rel: float | None = None,
            policy: Policy = SMALL, cells: list[dict[str, Any]] | None = None,
            history: list[dict[str, Any]] | None = None, now: float | None = None, fingerprint: str = "fp-1",
            policy_hash: str | None = None, ranks: list[dict[str, Any]] | None = None,
            **run_over: Any) -> RunRollups:
    """A run whose every criterion passes under SMALL unless told otherwise.

    Slots: the first half of each layer's samples in history (t = T0), the second half in the recent
    window (mean ``recent_rel``, default ``rel``). Ranks: each layer's samples shared equally by the
    ``tp_size`` ranks (default 1) unless ``ranks`` (rows of rank, layer, n, n_empty) is given.
    """
    if cells is None:
        cells = [cell(lay, n_per_layer, rel) for lay in range(num_layers)]
    recent_rel = rel if recent_rel is None else recent_rel
    last = T0 + span
    slots = []
    for lay in range(num_layers):
        slots.append(slot(lay, T0, n_per_layer / 2, rel))
        slots.append(slot(lay, last - 10, n_per_layer / 2, recent_rel))
    run: dict[str, Any] = {
        "id": 1, "run_key": "run-a", "num_layers": num_layers, "tp_size": 1, "candidate_name": "cand",
        "candidate_fingerprint": fingerprint, "n_samples": sum(c["n"] for c in cells),
        "n_errors": sum(c["n_error"] for c in cells), "n_cand_nonfinite": sum(c["n_cand_nonfinite"] for c in cells),
        "n_base_nonfinite": sum(c["n_base_nonfinite"] for c in cells), "n_requests": requests,
        "n_oracle": sum(c["n_oracle"] for c in cells), "first_sample_ts": T0, "last_sample_ts": last,
    }
    run.update(run_over)
    ph = policy.hash() if policy_hash is None else policy_hash
    run["policy_hash"] = ph
    if ranks is None:
        per_layer: dict[int, float] = {}
        for c in cells:
            per_layer[c["layer"]] = per_layer.get(c["layer"], 0.0) + c["n"]
        tp = int(run.get("tp_size") or 1)
        ranks = [rank_row(k, lay, n / tp) for k in range(tp) for lay, n in sorted(per_layer.items())]
    return RunRollups(run=run, cells=cells, slots=slots, hists={}, steps=StepCounts(steps, exceeded, ph),
                      now=last + 5 if now is None else now, history=history or [], ranks=ranks)


def rank_row(rank: int, layer: int, n: float, n_empty: float = 0) -> dict[str, Any]:
    """A rollup_ranks row: ``n`` compared calls of ``rank`` in ``layer`` (``n_empty`` that compared nothing)."""
    return {"rank": rank, "layer": layer, "n": n, "n_empty": n_empty, "first_ts": T0, "last_ts": T0 + 600}


def criterion(report: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in report["criteria"] if c["name"] == name)


def statuses(report: dict[str, Any]) -> dict[str, str]:
    return {c["name"]: c["status"] for c in report["criteria"]}
