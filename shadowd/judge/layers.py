"""The per-layer readiness table: what each layer contributes to the verdict.

Every layer that a criterion which did not pass names (the verdict's ``failing_layers`` and its reasons' ``[layers
…]``) is marked in the table: its ``criteria`` lists them, its ``status`` is at least as bad, and its ``problems``
say why in this layer (tolerance and drift are judged here exactly as the criteria judge them: per shape bucket,
unexplained NaN statistics included, and every statistic's drift).
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

from shadowd.judge.criteria import TOL_STATS, fold_layers, mean_of, not_le
from shadowd.judge.drift import _drift_check
from shadowd.judge.inputs import RunRollups
from shadowd.judge.policy import Policy
from shadowd.judge.report import FAIL, PASS, bucket_label, jsonable
from shadowd.judge.verdict import evaluate_criteria

__all__ = ["layer_table"]

_SEVERITY = {"ok": 0, "insufficient": 1, "fail": 2}


#: shape buckets named per layer and statistic (the rest are counted)
BUCKETS_SHOWN = 3


def _cell_problems(r: RunRollups, p: Policy, layer_means: dict[int, dict[str, float]]) -> dict[int, list[str]]:
    """Per layer, what fails the tolerance criterion in its (layer, shape bucket) cells beyond the layer's own
    means: a bucket whose mean is beyond a tolerance the layer's mean is within (worst first), and calls with NaN
    statistics that no non-finite output or error explains."""
    bad: dict[tuple[int, str], list[tuple[float, str]]] = defaultdict(list)
    nan: dict[int, int] = defaultdict(int)
    for c in r.cells:
        n = float(c.get("n") or 0.0)
        if n <= 0:
            continue
        lay = int(c["layer"])
        for name, col, tol in TOL_STATS:
            m = mean_of(float(c.get(col) or 0.0), n)
            if not_le(m, p.tol(tol)):
                bad[(lay, name)].append((m, bucket_label(c)))
        unexplained = float(c.get("n_nan_unexplained") or 0.0)
        if unexplained > 0:
            nan[lay] += int(unexplained)
    out: dict[int, list[str]] = defaultdict(list)
    for (lay, name), found in sorted(bad.items()):
        limit = p.tol(next(knob for stat, _, knob in TOL_STATS if stat == name))
        if not_le(layer_means[lay][name], limit):
            out[lay].append("")  # the layer's own mean says it (a marker: the layer fails tolerance)
            continue
        found.sort(key=lambda x: (not math.isnan(x[0]), -x[0] if not math.isnan(x[0]) else 0.0))
        shown = ", ".join(f"{label} {m:.3g}" for m, label in found[:BUCKETS_SHOWN])
        more = f" and {len(found) - BUCKETS_SHOWN} more" if len(found) > BUCKETS_SHOWN else ""
        out[lay].append(f"mean {name} > {limit:.3g} in shape bucket{'s' if len(found) > 1 else ''} {shown}{more}")
    for lay, k in nan.items():
        out[lay].append(f"{k} calls with NaN error statistics and no non-finite output to explain it")
    return out


def layer_table(r: RunRollups, p: Policy) -> list[dict[str, Any]]:
    """One row per declared (or seen) layer: counts, mean statistics, drift ratio, problems, and the criteria of
    the verdict that name the layer (``criteria``; ``status`` is at least as bad as theirs)."""
    cells = fold_layers(r.cells)
    cut = r.recent_end - p.drift_window_s
    recent = fold_layers([s for s in r.slots if float(s["t"]) >= cut])
    history = fold_layers([s for s in r.slots if float(s["t"]) < cut])
    buckets: dict[int, int] = {}
    for c in r.cells:
        buckets[int(c["layer"])] = buckets.get(int(c["layer"]), 0) + 1
    tolerance = _cell_problems(r, p, {lay: {name: mean_of(a.get(col, 0.0), a.get("n", 0.0))
                                            for name, col, _ in TOL_STATS} for lay, a in cells.items()})
    naming: dict[int, list[tuple[str, str]]] = defaultdict(list)
    for crit in evaluate_criteria(r, p):
        if crit.status != PASS and not crit.informational:
            for lay in crit.layers:
                naming[int(lay)].append((crit.name, crit.status))
    rows = []
    for lay in sorted(set(range(int(r.run.get("num_layers") or 0))) | set(cells)):
        a = cells.get(lay, {})
        n = a.get("n", 0.0)
        problems: list[str] = []
        failing = False
        if a.get("n_cand_nonfinite"):
            problems.append(f"{int(a['n_cand_nonfinite'])} candidate-only non-finite calls")
        if a.get("n_error"):
            problems.append(f"{int(a['n_error'])} candidate errors")
        means = {name: mean_of(a.get(col, 0.0), n) for name, col, _ in TOL_STATS}
        for name, _, tol in TOL_STATS:
            if n and not means[name] <= p.tol(tol):
                problems.append(f"mean {name} {means[name]:.3g} > {p.tol(tol):.3g}")
        if lay in tolerance:
            problems += [x for x in tolerance[lay] if x]
            failing = True
        if n < p.min_cell_samples:
            problems.append(f"{int(n)} samples < {p.min_cell_samples}")
        ra, ha = recent.get(lay, {}), history.get(lay, {})
        ratio = mean_of(mean_of(ra.get("sum_rel_l2", 0.0), ra.get("n", 0.0)),
                        mean_of(ha.get("sum_rel_l2", 0.0), ha.get("n", 0.0)))
        if ra.get("n", 0.0) >= p.drift_min_samples and ha.get("n", 0.0) >= p.drift_min_samples:
            for name in _drift_check(ra, ha, p):
                col = next(col for stat, col, _ in TOL_STATS if stat == name)
                r_of = mean_of(mean_of(ra[col], ra["n"]), mean_of(ha[col], ha["n"]))
                problems.append(f"recent {name} {r_of:.3g}× history")
                failing = True
        status = "fail" if (failing or a.get("n_cand_nonfinite") or a.get("n_error")) else (
            "insufficient" if problems else "ok")
        for name, crit_status in naming.get(lay, []):
            need = "fail" if crit_status == FAIL else "insufficient"
            if _SEVERITY[need] > _SEVERITY[status]:
                status = need
            if name == "oracle":
                problems.append(f"median oracle error ratio above k={p.oracle_k:g}")
            elif name == "exceedance":
                problems.append(f"{int(a.get('n_exceed', 0))} calls beyond tolerance (the run's exceeding-step "
                                f"rate: {'FAIL' if crit_status == FAIL else 'NEED MORE DATA'})")
        if status != "ok" and not problems:  # a criterion named the layer: say which
            problems += [f"{name}: {'FAIL' if st == FAIL else 'NEED MORE DATA'}" for name, st in naming[lay]]
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
            "criteria": [name for name, _ in naming.get(lay, [])],
        }))
    return rows
