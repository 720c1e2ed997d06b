"""The run's tensor-parallel ranks: which lack evidence (coverage), and which producers gave up on the candidate.

A run registers ``tp_size``; every rank in [0, tp_size) runs its own shard of every layer, so a rank that never
reports (a crashed worker, a misconfigured ``SHADOWD_URL``) leaves its shard unjudged: coverage needs each rank
to have ``min_cell_samples`` compared calls in every layer (from rollup_ranks). Calls that compared nothing
(``numel`` 0 and no error) do not count.

A producer (one process of a rank) that disabled its candidate or whose on mode fell back to the baseline saw the
candidate fail, even when the samples that showed it were dropped on the way (a full spool) or never sent: the
``producers`` criterion fails, naming the rank (and the pipeline stage, above 0) and the producer's own note.
Every producer of the run counts, also one whose rank has restarted since (a restarted process is a new
producer): like a hard failure, it holds for the rest of the run.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from shadowd.judge.inputs import RunRollups
from shadowd.judge.policy import Policy
from shadowd.judge.report import FAIL, PASS, Criterion

__all__ = ["producers", "rank_gaps"]


def _listed(xs: list[int], limit: int = 8) -> str:
    shown = ", ".join(str(x) for x in xs[:limit])
    return shown + (f" and {len(xs) - limit} more" if len(xs) > limit else "")


def rank_gaps(r: RunRollups, need: int) -> tuple[list[str], dict[str, Any]]:
    """What rank coverage lacks: one line per gap (``rank 2, 3: no samples``; empty when every rank in
    [0, tp_size) has ``need`` compared calls in every layer) and what was observed."""
    tp = max(1, int(r.run.get("tp_size") or 1))
    num_layers = int(r.run.get("num_layers") or 0)
    n: dict[tuple[int, int], float] = defaultdict(float)
    empty: dict[int, float] = defaultdict(float)
    for row in r.ranks:
        n[(int(row["rank"]), int(row["layer"]))] += float(row.get("n") or 0)
        empty[int(row["rank"])] += float(row.get("n_empty") or 0)
    layers = sorted(set(range(num_layers)) | {lay for _, lay in n})
    silent = [k for k in range(tp) if not any(n.get((k, lay), 0.0) for lay in layers)]
    parts = []
    if nothing := [k for k in silent if not empty.get(k)]:
        parts.append(f"rank {_listed(nothing)}: no samples")
    for k in silent:
        if empty.get(k):
            parts.append(f"rank {k}: no compared samples ({int(empty[k])} compared nothing: numel 0)")
    short: dict[int, list[int]] = {}
    for k in range(tp):
        lays = [lay for lay in layers if n.get((k, lay), 0.0) < need]
        if k not in silent and lays:
            short[k] = lays
            parts.append(f"rank {k}: {len(lays)} of {len(layers)} layers below {need} compared samples "
                         f"(layers {_listed(lays)})")
    least = min((n.get((k, lay), 0.0) for k in range(tp) for lay in layers), default=0.0)
    observed = {"ranks": tp, "ranks_without_samples": silent, "ranks_short": sorted(short),
                "min_rank_layer_samples": least}
    return parts, observed


def producers(r: RunRollups, p: Policy) -> Criterion:
    """No producer of the run disabled its candidate or fell back to the baseline (sticky for the run)."""
    lines: list[str] = []
    flagged: list[dict[str, Any]] = []
    for row in sorted(r.producers, key=lambda x: (int(x.get("stage") or 0), int(x.get("rank") or 0),
                                                  float(x.get("first_seen") or 0.0))):
        disabled = bool(row.get("disabled")) or row.get("disabled_reason") is not None
        fallback = bool(row.get("fallback")) or row.get("fallback_reason") is not None
        if not (disabled or fallback):
            continue
        stage = int(row.get("stage") or 0)
        who = (f"{f'stage {stage} ' if stage else ''}rank {int(row.get('rank') or 0)} "
               f"(producer {str(row.get('producer', ''))[:12]})")
        if disabled:
            lines.append(f"{who}: candidate disabled: {row.get('disabled_reason') or 'no reason reported'}")
        if fallback:
            lines.append(f"{who}: on mode fell back to the baseline: "
                         f"{row.get('fallback_reason') or 'no reason reported'}")
        flagged.append({k: row.get(k) for k in ("stage", "rank", "producer", "disabled_reason", "fallback_reason")})
    observed = {"producers": len(r.producers), "gave_up": len(flagged)}
    if lines:
        return Criterion("producers", FAIL, observed, {"gave_up": 0}, "; ".join(lines), extra={"flagged": flagged})
    return Criterion("producers", PASS, observed, {"gave_up": 0},
                     f"none of the run's {len(r.producers)} producers disabled its candidate or fell back")
