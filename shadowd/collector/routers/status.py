"""``GET /``: the built-in status page — one run's verdict, per-layer heatmap and exceedance over time.

Server-rendered HTML with inline SVG (no JavaScript, no external assets), read from the latest stored
evaluation and the rollup tables only (never raw samples). ``?run_id=N`` selects a run; the latest
run otherwise. Like ``/metrics`` it needs no token: it shows aggregates only, never sample data.
"""

from __future__ import annotations

import datetime as dt
import html
import json
import logging
import math
import string
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from fastapi import APIRouter, Query
from fastapi.responses import HTMLResponse
from sqlalchemy import Engine, select
from sqlalchemy.exc import DBAPIError
from starlette.concurrency import run_in_threadpool

from shadowd import __version__
from shadowd.collector import queries
from shadowd.collector import tables as t
from shadowd.collector.charts import exceedance_svg, heatmap_svg
from shadowd.collector.deps import ROW_ID_MAX, State
from shadowd.collector.store import UnknownRun

__all__ = ["StatusData", "load_status", "render_status", "router"]

router = APIRouter(tags=["status"])

log = logging.getLogger("shadowd.collector")
#: seconds between reloads of the outage page (and its Retry-After)
OUTAGE_RELOAD_S = 5
#: time buckets read back from the run's last sample
WINDOW_BUCKETS = 720


@dataclass
class StatusData:
    """Everything the page shows, read in one go."""

    runs: list[dict[str, Any]]
    run: dict[str, Any] | None = None
    evaluation: dict[str, Any] | None = None
    layers: list[dict[str, Any]] = field(default_factory=list)
    slots: list[dict[str, Any]] = field(default_factory=list)
    producers: list[dict[str, Any]] = field(default_factory=list)
    timing: dict[str, Any] | None = None
    tolerance: float = 1.6e-2
    bucket_s: int = 60


def load_status(engine: Engine, run_id: int | None, tolerance: float, bucket_s: int) -> StatusData:
    """Read the page's data; raises UnknownRun for an unknown ``run_id``."""
    runs = queries.list_runs(engine, limit=200)
    data = StatusData(runs=runs, tolerance=tolerance, bucket_s=bucket_s)
    if not runs and run_id is None:
        return data
    run = queries.run_row(engine, run_id)
    data.run = run
    if all(r["id"] != run["id"] for r in runs):  # an older run than the picker lists: it is the one shown
        data.runs = [*runs, run]
    data.layers = queries.layer_summary(engine, run["id"])
    data.producers = queries.producers_of(engine, run["id"])
    data.timing = queries.timing(engine, run["id"])
    c = t.timeslots.c
    with engine.connect() as conn:
        ev = (
            conn.execute(
                select(t.evaluations)
                .where(t.evaluations.c.run_id == run["id"])
                .order_by(t.evaluations.c.at.desc(), t.evaluations.c.id.desc())
                .limit(1)
            )
            .mappings()
            .first()
        )
        data.evaluation = dict(ev) if ev is not None else None
        q = select(
            c.layer, c.t, c.n, c.n_exceed, c.n_cand_nonfinite, c.n_base_nonfinite, c.n_error, c.n_nan_unexplained,
            c.max_rel_l2, c.sum_rel_l2,
        ).where(c.run_id == run["id"])
        if run["last_sample_ts"] is not None:
            q = q.where(c.t >= run["last_sample_ts"] - WINDOW_BUCKETS * bucket_s)
        data.slots = [dict(r) for r in conn.execute(q).mappings()]
    return data


# ----------------------------------------------------------------------------------------------- plots


def _utc(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _fmt(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if v != v or v in (math.inf, -math.inf):
            return str(v)
        return f"{v:.4g}"
    if isinstance(v, dict):
        return ", ".join(f"{k} {_fmt(x)}" for k, x in v.items())
    if isinstance(v, list):
        return ", ".join(_fmt(x) for x in v)
    return str(v)


# ----------------------------------------------------------------------------------------------- page

_e = html.escape


def _table(headers: list[str], rows: list[list[str]], numeric: set[int] | None = None) -> str:
    numeric = numeric or set()
    head = "".join(
        f'<th class="num">{_e(h)}</th>' if i in numeric else f"<th>{_e(h)}</th>"
        for i, h in enumerate(headers)
    )
    body = "".join(
        "<tr>"
        + "".join(f'<td class="num">{c}</td>' if i in numeric else f"<td>{c}</td>" for i, c in enumerate(row))
        + "</tr>"
        for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _report(evaluation: dict[str, Any]) -> dict[str, Any]:
    try:
        report = json.loads(evaluation.get("report") or "{}")
    except (TypeError, ValueError):
        report = {}
    return report if isinstance(report, dict) else {}


def _criterion_status(c: dict[str, Any]) -> str:
    status = str(c.get("status") or "").lower()
    if status in ("pass", "fail", "insufficient"):
        return status
    return "pass" if c.get("passed") else "fail"


def _criterion_order(c: dict[str, Any]) -> int:
    return {"fail": 0, "insufficient": 1, "pass": 2}[_criterion_status(c)]


def _criterion_mark(c: dict[str, Any]) -> str:
    return {
        "fail": '<span class="fail">FAIL</span>',
        "insufficient": '<span class="need">need data</span>',
        "pass": '<span class="pass">pass</span>',
    }[_criterion_status(c)]


def _verdict_section(data: StatusData) -> str:
    ev = data.evaluation
    if ev is None:
        return (
            '<section id="verdict"><h2>Verdict</h2><span class="verdict v-NONE">no evaluation yet</span> '
            '<span class="muted">the readiness judge has not stored an evaluation of this run</span>'
            "</section>"
        )
    report = _report(ev)
    verdict = str(ev.get("verdict") or report.get("verdict") or "UNKNOWN")
    css = verdict if verdict in ("READY", "NOT_READY", "INSUFFICIENT_DATA") else "NONE"
    reasons = [str(r) for r in report.get("reasons") or [] if r is not None]
    parts = [
        f'<section id="verdict"><h2>Verdict</h2><span class="verdict v-{css}">{_e(verdict)}</span> '
        f'<span class="muted">evaluated {_e(_utc(float(ev["at"])))} '
        f"· policy {_e(str(ev['policy_hash'])[:12])}"
        f" · candidate {_e(str(ev['candidate_fingerprint']))}</span>"
    ]
    if reasons:
        parts.append('<ul class="reasons">' + "".join(f"<li>{_e(r)}</li>" for r in reasons) + "</ul>")
    criteria = [c for c in report.get("criteria") or [] if isinstance(c, dict)]
    if criteria:
        criteria.sort(key=_criterion_order)
        rows = [
            [
                _e(str(c.get("name", "?"))),
                _criterion_mark(c),
                f'<span class="wrap">{_e(_fmt(c.get("observed")))}</span>',
                f'<span class="wrap">{_e(_fmt(c.get("threshold")))}</span>',
                f'<span class="wrap muted">{_e(str(c.get("detail") or ""))}</span>',
            ]
            for c in criteria
        ]
        parts.append(
            '<h2 style="margin-top:10px">Criteria</h2>'
            + _table(["criterion", "", "observed", "threshold", "detail"], rows)
        )
    parts.append("</section>")
    return "".join(parts)


def _speedup(timing: dict[str, Any] | None) -> str:
    """The run's measured speed-up (``queries.timing``) for the run section, with its lowest shape bucket."""
    if not timing or timing.get("speedup") is None:
        return "no timed calls yet"
    text = (f"{timing['speedup']:.2f}× · {timing['candidate_us']:.1f} / {timing['baseline_us']:.1f} µs per call "
            f"(candidate / baseline) · {timing['timed_calls']:,} timed calls")
    low = timing.get("lowest_bucket")
    if low is not None:
        text += f" · lowest {low['speedup']:.2f}× in {low['bucket']}"
    return text


def _run_section(run: dict[str, Any], producers: list[dict[str, Any]] | None = None,
                 timing: dict[str, Any] | None = None) -> str:
    spec = queries.speculative_of(producers or [])
    accept = " · ".join(f"{m} {v['accept_length']:.2f}" for m, v in spec.items()) or "not reported"
    shapes = queries.on_mode_shapes_of(producers or [])
    on_calls = "no on-mode call" if not shapes else (
        f"{shapes['covered_calls']:,} on covered shapes · {shapes['uncovered_calls']:,} outside them (baseline "
        f"served, {shapes['uncovered_calls'] / (shapes['covered_calls'] + shapes['uncovered_calls']):.1%})")
    items = [
        ("run", f"{run['id']} · {run['run_key']}"),
        ("model", run["model"]),
        ("candidate", f"{run['candidate_name']} ({run['candidate_fingerprint']})"),
        ("baseline", f"{run['baseline_name']} ({run['baseline_fingerprint']})"),
        ("GPU", f"{run['gpu_name']} {run['gpu_arch']} · driver {run['driver']}".strip()),
        ("layers · TP", f"{run['num_layers']} · {run['tp_size']}"),
        ("samples", _fmt(run["n_samples"])),
        ("batches (duplicates)", f"{run['n_batches']:,} ({run['n_duplicates']:,})"),
        ("beyond tolerance", _fmt(run["n_exceed"])),
        ("non-finite (candidate only)", _fmt(run["n_cand_nonfinite"])),
        ("started", _utc(run["started_at"])),
        ("last ingest", _utc(run["last_ingest_at"]) if run["last_ingest_at"] else "never"),
        ("kill switch", run["mode_override"] or "none"),
        ("accept length by mode", accept),
        ("on-mode calls", on_calls),
        ("speed-up", _speedup(timing)),
    ]
    body = "".join(f"<dt>{_e(k)}</dt><dd>{_e(str(v))}</dd>" for k, v in items)
    return f'<section id="run"><h2>Run</h2><dl class="info">{body}</dl></section>'


def _layers_section(layers: list[dict[str, Any]]) -> str:
    rows = []
    for r in layers:
        flag = ' class="fail"' if r["cand_nonfinite"] or r["errors"] else ""
        timing = (
            f"{r['cand_us']:.1f} / {r['base_us']:.1f}"
            if r["cand_us"] is not None and r["base_us"] is not None
            else "–"
        )
        rows.append(
            [
                f"<span{flag}>{r['layer']}</span>",
                _fmt(r["samples"]),
                _fmt(r["buckets"]),
                _fmt(r["exceeded"]),
                _fmt(r["cand_nonfinite"]),
                _fmt(r["errors"]),
                _fmt(r["mean_rel_l2"]),
                _fmt(r["max_rel_l2"]),
                _fmt(r["max_max_abs"]),
                _fmt(r["max_cos_diff"]),
                timing,
            ]
        )
    table = _table(
        [
            "layer",
            "samples",
            "buckets",
            "beyond tol",
            "non-finite",
            "errors",
            "mean rel-L2",
            "max rel-L2",
            "max max-abs",
            "max cos-diff",
            "µs cand / base",
        ],
        rows,
        set(range(1, 11)),
    )
    return f'<section id="layers"><h2>Layers</h2>{table}</section>'


def _producers_section(producers: list[dict[str, Any]]) -> str:
    if not producers:
        return ""
    # the pipeline stage, in runs of several stages only (they share TP ranks)
    staged = any(int(p.get("stage") or 0) for p in producers)
    rows = [
        [
            _e(str(p["producer"])[:12]),
            *([_fmt(int(p.get("stage") or 0))] if staged else []),
            _fmt(p["rank"]),
            _fmt(p["batches"]),
            _fmt(p["samples"]),
            _fmt(p["gaps"]),
            _fmt(p["spool_depth"]),
            _fmt(p["dropped"]),
            _fmt(bool(p["fallback"])),
            _fmt(bool(p["disabled"])),
            _e(p.get("disabled_reason") or p.get("fallback_reason") or ""),
            _e(_utc(p["last_seen"])),
        ]
        for p in producers
    ]
    table = _table(
        [
            "producer",
            *(["stage"] if staged else []),
            "rank",
            "batches",
            "samples",
            "gaps",
            "spool",
            "dropped",
            "fallback",
            "disabled",
            "why",
            "last seen",
        ],
        rows,
        set(range(1, 8 if staged else 7)),
    )
    return f'<section id="producers"><h2>Producers</h2>{table}</section>'


def _run_form(runs: list[dict[str, Any]], current: int | None) -> str:
    if not runs:
        return ""
    options = "".join(
        f'<option value="{r["id"]}"{" selected" if r["id"] == current else ""}>'
        f"{r['id']} · {_e(r['run_key'])} · {_e(r['candidate_name'])}</option>"
        for r in runs
    )
    return (
        f'<form method="get" action="/"><label for="run_id">run</label>'
        f'<select id="run_id" name="run_id">{options}</select><button type="submit">show</button></form>'
    )


def _template() -> string.Template:
    text = resources.files("shadowd.collector").joinpath("templates/status.html").read_text(encoding="utf-8")
    return string.Template(text)


def render_status(data: StatusData) -> str:
    """The whole page as HTML."""
    run = data.run
    if run is None:
        body = (
            "<section><h2>No runs yet</h2><p>Producers register a run with <code>POST /v1/runs</code>; "
            "it appears here with its first samples.</p></section>"
        )
        return _template().substitute(title="shadowd status", version=_e(__version__), run_form="", body=body)
    window = (
        f'<span class="muted">last {len({s["t"] for s in data.slots})} time buckets of {data.bucket_s} s'
        "</span>"
    )
    body = "".join(
        [
            _verdict_section(data),
            _run_section(run, data.producers, data.timing),
            '<section id="heatmap-section"><h2>Per-layer heatmap: largest per-call rel-L2 vs tolerance</h2>'
            f"{window}"
            f'<div class="plot">{heatmap_svg(data.slots, int(run["num_layers"]), data.tolerance)}</div>'
            "</section>",
            f'<section id="exceedance-section"><h2>Exceedance over time</h2>'
            f'<div class="plot">{exceedance_svg(data.slots)}</div></section>',
            _layers_section(data.layers),
            _producers_section(data.producers),
        ]
    )
    title = f"shadowd · run {run['id']} · {run['run_key']}"
    return _template().substitute(
        title=_e(title), version=_e(__version__), run_form=_run_form(data.runs, int(run["id"])), body=body
    )


@router.get("/", response_class=HTMLResponse)
async def status_page(state: State, run_id: int | None = Query(None, ge=1, le=ROW_ID_MAX)) -> HTMLResponse:
    """The status page of run ``run_id`` (the latest run when omitted)."""
    tol = state.policy.tol("rel_l2_max")

    def work() -> str:
        return render_status(load_status(state.engine, run_id, tol, state.settings.time_bucket_s))

    try:
        page = await run_in_threadpool(work)
    except UnknownRun:
        body = f'<section><h2>Run {run_id} does not exist</h2><p><a href="/">latest run</a></p></section>'
        page = _template().substitute(title="shadowd status", version=_e(__version__), run_form="", body=body)
        return HTMLResponse(page, status_code=404)
    except DBAPIError as exc:
        # a page for the person watching it through an outage (the API's answer is JSON): it says what is wrong
        # and reloads itself until the database answers again
        log.warning("database error on the status page: %s", type(exc.orig).__name__)
        body = (f"<section><h2>The database is unavailable</h2><p>The collector could not read it "
                f"({_e(type(exc.orig).__name__)}). Nothing is lost: producers spool their samples and deliver them "
                f"once it is back. This page reloads every {OUTAGE_RELOAD_S} s.</p></section>")
        page = _template().substitute(title="shadowd status", version=_e(__version__), run_form="", body=body)
        return HTMLResponse(page, status_code=503,
                            headers={"Retry-After": str(OUTAGE_RELOAD_S), "Refresh": str(OUTAGE_RELOAD_S)})
    return HTMLResponse(page)
