"""The per-layer readiness table: what each layer contributes to the verdict."""

from __future__ import annotations

import math
from typing import Any

from shadowd.judge.criteria import TOL_STATS, fold_layers, mean_of
from shadowd.judge.drift import DRIFT_FLOOR
from shadowd.judge.inputs import RunRollups
from shadowd.judge.policy import Policy
from shadowd.judge.report import jsonable

__all__ = ["layer_table"]


def layer_table(r: RunRollups, p: Policy) -> list[dict[str, Any]]:
    """One row per declared (or seen) layer: counts, mean statistics, drift ratio and problems."""
    cells = fold_layers(r.cells)
    cut = r.recent_end - p.drift_window_s
    recent = fold_layers([s for s in r.slots if float(s["t"]) >= cut])
    history = fold_layers([s for s in r.slots if float(s["t"]) < cut])
    buckets: dict[int, int] = {}
    for c in r.cells:
        buckets[int(c["layer"])] = buckets.get(int(c["layer"]), 0) + 1
    rows = []
    for lay in sorted(set(range(int(r.run.get("num_layers") or 0))) | set(cells)):
        a = cells.get(lay, {})
        n = a.get("n", 0.0)
        problems: list[str] = []
        if a.get("n_cand_nonfinite"):
            problems.append(f"{int(a['n_cand_nonfinite'])} candidate-only non-finite calls")
        if a.get("n_error"):
            problems.append(f"{int(a['n_error'])} candidate errors")
        means = {name: mean_of(a.get(col, 0.0), n) for name, col, _ in TOL_STATS}
        for name, _, tol in TOL_STATS:
            if n and not means[name] <= p.tol(tol):
                problems.append(f"mean {name} {means[name]:.3g} > {p.tol(tol):.3g}")
        if n < p.min_cell_samples:
            problems.append(f"{int(n)} samples < {p.min_cell_samples}")
        ra, ha = recent.get(lay, {}), history.get(lay, {})
        ratio = mean_of(mean_of(ra.get("sum_rel_l2", 0.0), ra.get("n", 0.0)),
                      mean_of(ha.get("sum_rel_l2", 0.0), ha.get("n", 0.0)))
        if (ra.get("n", 0.0) >= p.drift_min_samples and ha.get("n", 0.0) >= p.drift_min_samples
                and not mean_of(ra["sum_rel_l2"], ra["n"])
                <= p.drift_ratio * mean_of(ha["sum_rel_l2"], ha["n"]) + DRIFT_FLOOR * p.tol("rel_l2_max")):
            problems.append(f"recent rel_l2 {ratio:.3g}× history")
        status = "fail" if (a.get("n_cand_nonfinite") or a.get("n_error") or any(
            "mean" in x or "history" in x for x in problems)) else ("insufficient" if problems else "ok")
        rows.append(jsonable({
            "layer": lay,
            "status": status,
            "problems": problems,
            "samples": int(n),
            "buckets": buckets.get(lay, 0),
            "exceeded_calls": int(a.get("n_exceed", 0)),
            "exceeded_rate": mean_of(a.get("n_exceed", 0.0), n) if n else None,
            "errors": int(a.get("n_error", 0)),
            "cand_nonfinite": int(a.get("n_cand_nonfinite", 0)),
            "base_nonfinite": int(a.get("n_base_nonfinite", 0)),
            "nan_stats": int(a.get("n_nan_stat", 0)),
            "oracle_samples": int(a.get("n_oracle", 0)),
            **{f"mean_{k}": (v if n else None) for k, v in means.items()},
            "recent_vs_history_rel_l2": None if math.isnan(ratio) else ratio,
        }))
    return rows
