"""Reads: runs, producers, per-layer summaries and judge snapshots — all from rollups."""

from __future__ import annotations

import math
import time
from collections import defaultdict
from typing import Any

from sqlalchemy import Engine, func, select

from shadowd.collector import tables as t
from shadowd.collector.store import UnknownRun
from shadowd.judge.inputs import RunRollups, StepCounts
from shadowd.judge.report import bucket_label
from shadowd.wire import SPEC_MODES

__all__ = ["layer_summary", "list_runs", "load_rollups", "on_mode_shapes_of", "producer_notes", "producers_of",
           "run_row", "runs_for_metrics", "speculative", "speculative_of", "timing"]


def list_runs(engine: Engine, limit: int = 100, offset: int = 0) -> list[dict[str, Any]]:
    with engine.connect() as conn:
        rows = conn.execute(select(t.runs).order_by(t.runs.c.id.desc()).limit(limit).offset(offset))
        return [dict(r) for r in rows.mappings()]


def run_row(engine: Engine, run_id: int | None) -> dict[str, Any]:
    """The run ``run_id``, or the latest run when None."""
    with engine.connect() as conn:
        q = select(t.runs)
        q = q.where(t.runs.c.id == run_id) if run_id is not None else q.order_by(t.runs.c.id.desc()).limit(1)
        row = conn.execute(q).mappings().first()
    if row is None:
        raise UnknownRun(run_id if run_id is not None else "latest")
    return dict(row)


def producers_of(engine: Engine, run_id: int) -> list[dict[str, Any]]:
    with engine.connect() as conn:
        rows = conn.execute(select(t.producers).where(t.producers.c.run_id == run_id)
                            .order_by(t.producers.c.stage, t.producers.c.rank, t.producers.c.first_seen))
        return [dict(r) for r in rows.mappings()]


def producer_notes(engine: Engine, run_id: int) -> list[dict[str, Any]]:
    """The producers of a run whose candidate was disabled or fell back (flag or reason reported), by (stage, rank)."""
    p = t.producers.c
    q = (select(p.stage, p.rank, p.producer, p.disabled_reason, p.fallback_reason)
         .where(p.run_id == run_id, (p.disabled > 0) | (p.fallback > 0) | (p.disabled_reason.is_not(None))
                | (p.fallback_reason.is_not(None)))
         .order_by(p.stage, p.rank, p.first_seen))
    with engine.connect() as conn:
        return [dict(r) for r in conn.execute(q).mappings()]


def _cells(engine: Engine, run_id: int) -> list[dict[str, Any]]:
    with engine.connect() as conn:
        rows = conn.execute(select(t.cells).where(t.cells.c.run_id == run_id))
        return [dict(r) for r in rows.mappings()]


def layer_summary(engine: Engine, run_id: int) -> list[dict[str, Any]]:
    """Per-layer summary of a run, folded from its (layer, bucket) cells. A mean is the statistic's sum (a
    non-finite value adds nothing to it) over the calls whose statistics are all finite (``nan_stats`` counts the
    others), None when there is none — never the 0 of an empty sum."""
    acc: dict[int, dict[str, Any]] = {}
    for c in _cells(engine, run_id):
        a = acc.setdefault(c["layer"], defaultdict(float))
        for k in ("n", "n_exceed", "n_error", "n_cand_nonfinite", "n_base_nonfinite", "n_nan_stat", "n_timed",
                  "sum_rel_l2", "sum_max_abs", "sum_cos_diff", "sum_cand_us", "sum_base_us", "n_oracle"):
            a[k] += c[k]
        for k in ("max_rel_l2", "max_max_abs", "max_cos_diff", "max_scaled", "max_max_rel", "max_oracle_ratio"):
            a[k] = max(a[k], c[k])
        a["buckets"] += 1
    out = []
    for layer in sorted(acc):
        a = acc[layer]
        finite = a["n"] - a["n_nan_stat"]
        out.append({
            "layer": layer,
            "samples": int(a["n"]),
            "buckets": int(a["buckets"]),
            "exceeded": int(a["n_exceed"]),
            "errors": int(a["n_error"]),
            "cand_nonfinite": int(a["n_cand_nonfinite"]),
            "base_nonfinite": int(a["n_base_nonfinite"]),
            "nan_stats": int(a["n_nan_stat"]),
            "oracle_samples": int(a["n_oracle"]),
            "mean_rel_l2": a["sum_rel_l2"] / finite if finite > 0 else None,
            "max_rel_l2": a["max_rel_l2"],
            "mean_max_abs": a["sum_max_abs"] / finite if finite > 0 else None,
            "max_max_abs": a["max_max_abs"],
            "max_scaled_max_abs": a["max_scaled"],
            "mean_cos_diff": a["sum_cos_diff"] / finite if finite > 0 else None,
            "max_cos_diff": a["max_cos_diff"],
            "max_oracle_ratio": a["max_oracle_ratio"],
            "cand_us": a["sum_cand_us"] / a["n_timed"] if a["n_timed"] else None,
            "base_us": a["sum_base_us"] / a["n_timed"] if a["n_timed"] else None,
        })
    return out


def _timed(n: float, cand: float, base: float) -> dict[str, Any]:
    # (a candidate timed at ~0 µs beside a long baseline would make the ratio overflow: no speed-up then)
    ratio = base / cand if n and cand > 0 else None
    return {"timed_calls": int(n), "candidate_us": cand / n if n else None, "baseline_us": base / n if n else None,
            "speedup": ratio if ratio is not None and math.isfinite(ratio) else None}


def timing(engine: Engine, run_id: int) -> dict[str, Any]:
    """The speed-up the run measured — the reason to switch: mean candidate and baseline device time per timed call
    (both timed on the same call, from events around each), their ratio, overall and per shape bucket (busiest
    first), folded from the (layer, bucket) cells; ``lowest_bucket`` is the bucket of the lowest speed-up when
    there are several. ``speedup`` is None until a call was timed."""
    total = [0.0, 0.0, 0.0]
    per: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    for c in _cells(engine, run_id):
        if not c["n_timed"]:
            continue
        for acc in (total, per[bucket_label(c)]):
            acc[0] += c["n_timed"]
            acc[1] += c["sum_cand_us"]
            acc[2] += c["sum_base_us"]
    buckets = [{"bucket": label, **_timed(*v)} for label, v in sorted(per.items(), key=lambda kv: (-kv[1][0], kv[0]))]
    ranked = [b for b in buckets if b["speedup"] is not None]
    lowest = min(ranked, key=lambda b: b["speedup"]) if len(ranked) > 1 else None
    return {**_timed(*total), "buckets": buckets, "lowest_bucket": lowest}


def load_rollups(engine: Engine, run_id: int, now: float | None = None, recent_s: float = 900.0,
                 history: list[dict[str, Any]] | None = None, time_bucket_s: float = 60.0) -> RunRollups:
    """A judge snapshot of run ``run_id`` at ``now`` (rollup tables only); the recent window is the ``recent_s``
    before ``now``, or before the run's newest sample when that is earlier (``RunRollups.recent_end``)."""
    now = time.time() if now is None else now
    run = run_row(engine, run_id)
    with engine.connect() as conn:
        slots = [dict(r) for r in conn.execute(select(t.timeslots).where(t.timeslots.c.run_id == run_id)).mappings()]
        hists: dict[tuple[int, str], dict[int, int]] = defaultdict(dict)
        for r in conn.execute(select(t.hists.c.layer, t.hists.c.stat, t.hists.c.bin, t.hists.c["count"])
                              .where(t.hists.c.run_id == run_id)):
            hists[(r[0], r[1])][r[2]] = int(r[3])
        s = t.steps.c
        total, exceeded = conn.execute(
            select(func.count(), func.coalesce(func.sum(s.exceeded), 0)).where(s.run_id == run_id)
        ).one()
        last = run.get("last_sample_ts")
        end = now if last is None else min(now, float(last))  # RunRollups.recent_end
        recent_total, recent_exc = conn.execute(
            select(func.count(), func.coalesce(func.sum(s.exceeded), 0))
            .where((s.run_id == run_id) & (s.first_ts >= end - recent_s))
        ).one()
        e = t.errors.c
        errors = {str(r[0]): int(r[1]) for r in conn.execute(select(e.error, e.n).where(e.run_id == run_id))}
        ranks = [dict(r) for r in conn.execute(select(t.ranks).where(t.ranks.c.run_id == run_id)).mappings()]
    steps = StepCounts(int(total), int(exceeded), run["policy_hash"], int(recent_total), int(recent_exc))
    return RunRollups(run=run, cells=_cells(engine, run_id), slots=slots, hists=dict(hists), steps=steps,
                      now=now, history=history or [], errors=errors, ranks=ranks,
                      producers=producers_of(engine, run_id), time_bucket_s=time_bucket_s)


def runs_for_metrics(engine: Engine, since: float) -> list[dict[str, Any]]:
    """Runs with an ingest after ``since``, or a producer heard from after it (a stats-only batch of a producer
    whose samples were all dropped): the ones /metrics exports."""
    heard = select(t.producers.c.run_id).where(t.producers.c.last_seen >= since)
    with engine.connect() as conn:
        rows = conn.execute(select(t.runs).where((t.runs.c.last_ingest_at >= since) | t.runs.c.id.in_(heard)))
        return [dict(r) for r in rows.mappings()]


def speculative_of(producers: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """SGLang's speculative accept length per hook mode, from producers' cumulative counters.

    Every TP rank sees the same verify batches, so rank 0's producers are counted (all producers
    when no rank 0 reported) — of one pipeline stage: the stage that counted the most verify passes (under
    pipeline parallelism each stage's scheduler may count the same steps). ``accept_length`` = accepted tokens /
    request-steps (SGLang's "accept len"); ``tokens_per_step`` = accepted tokens / verify passes. Modes with no
    pass are left out.
    """
    rank0 = [p for p in producers if p["rank"] == 0] or producers
    by_stage: dict[int, list[dict[str, Any]]] = {}
    for p in rank0:
        by_stage.setdefault(int(p.get("stage") or 0), []).append(p)
    if by_stage:
        rank0 = max(by_stage.items(), key=lambda kv: (sum(int(p[f"spec_passes_{m}"]) for p in kv[1]
                                                          for m in SPEC_MODES), -kv[0]))[1]
    out: dict[str, dict[str, float]] = {}
    for mode in SPEC_MODES:
        tokens = sum(int(p[f"spec_accept_tokens_{mode}"]) for p in rank0)
        req_steps = sum(int(p[f"spec_req_steps_{mode}"]) for p in rank0)
        passes = sum(int(p[f"spec_passes_{mode}"]) for p in rank0)
        if passes:
            out[mode] = {
                "accept_length": tokens / req_steps if req_steps else 0.0,
                "tokens_per_step": tokens / passes,
                "verify_passes": passes,
                "request_steps": req_steps,
            }
    return out


def on_mode_shapes_of(producers: list[dict[str, Any]]) -> dict[str, int]:
    """On mode's calls over the run's processes (every producer, restarted ones included): on a shape bucket the
    promotion gate's verdict covers, and on one it does not (the baseline served those); {} before any."""
    covered = sum(int(p.get("on_covered_calls") or 0) for p in producers)
    uncovered = sum(int(p.get("on_uncovered_calls") or 0) for p in producers)
    return {"covered_calls": covered, "uncovered_calls": uncovered} if covered or uncovered else {}


def speculative(engine: Engine, run_id: int) -> dict[str, dict[str, float]]:
    """:func:`speculative_of` the run's producers."""
    return speculative_of(producers_of(engine, run_id))
