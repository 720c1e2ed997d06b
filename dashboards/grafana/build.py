"""Generate the shadowd Grafana dashboard.

``python dashboards/grafana/build.py`` writes dashboards/shadowd.json.

The JSON beside this script is the provisioned file; a test checks it is what this script writes,
that its structure is sound, and (against a real Prometheus scraping a real collector) that every
PromQL query runs and the key panels return data.

Collector series from the rollup tables are the same on every collector sharing one database:
they are aggregated with ``max``; per-process counters (samples, batches, exceeded, non-finite, ...)
with ``sum``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["DASHBOARD_PATH", "KEY_PANELS", "POSTGRES_UID", "PROMETHEUS_UID", "build", "main"]

PROMETHEUS_UID = "shadowd-prometheus"
POSTGRES_UID = "shadowd-postgres"
DASHBOARD_PATH = Path(__file__).resolve().parent / "dashboards" / "shadowd.json"

PROM = {"type": "prometheus", "uid": PROMETHEUS_UID}
PG = {"type": "grafana-postgresql-datasource", "uid": POSTGRES_UID}

#: panels that must return data from a collector fed with samples (checked by the integration test)
KEY_PANELS = (
    "Verdict per run",
    "p99 per-call max-abs by layer",
    "p99 per-call rel-L2 by layer",
    "Exceedance rate by layer",
    "Non-finite mismatch events",
    "Samples per layer",
    "Samples per shape bucket",
    "Ingest rate",
    "Producer spool depth",
    "Device time per call: candidate vs baseline",
    "Speculative accept length by hook mode",
)

R = 'run=~"$run"'
RL = 'run=~"$run", layer=~"$layer"'
RI = "[$__rate_interval]"

# The latest stored evaluation of each selected run, one row per failing criterion (PostgreSQL).
FAILING_CRITERIA_SQL = """\
SELECT e.run_id AS run, r.candidate_name AS candidate, e.verdict,
       c ->> 'name' AS criterion, coalesce(c ->> 'status', 'fail') AS status,
       c ->> 'observed' AS observed, c ->> 'threshold' AS threshold, c ->> 'detail' AS detail,
       to_timestamp(e.at) AS evaluated_at
FROM (SELECT DISTINCT ON (run_id) run_id, at, verdict, report FROM evaluations
      WHERE run_id::text IN ($run) ORDER BY run_id, at DESC) AS e
JOIN runs AS r ON r.id = e.run_id
CROSS JOIN LATERAL json_array_elements(e.report::json -> 'criteria') AS c
WHERE (c ->> 'passed')::boolean IS NOT TRUE
ORDER BY e.run_id, criterion"""

REASONS_SQL = """\
SELECT e.run_id AS run, e.verdict, reason, to_timestamp(e.at) AS evaluated_at
FROM (SELECT DISTINCT ON (run_id) run_id, at, verdict, report FROM evaluations
      WHERE run_id::text IN ($run) ORDER BY run_id, at DESC) AS e
CROSS JOIN LATERAL json_array_elements_text(e.report::json -> 'reasons') AS reason
ORDER BY e.run_id"""


def _by_worker(metric: str) -> str:
    """``metric`` per (run, pipeline stage, rank) with a ``worker`` label for the legend: ``rank R``, or
    ``stage S rank R`` for a stage above 0 (a legend cannot be conditional; launches without --pp-size are stage 0).
    """
    per = f"max by (run, stage, rank) ({metric}{{{R}}})"
    joined = f'label_join({per}, "stage_rank", " ", "stage", "rank")'
    ranked = f'label_replace({joined}, "worker", "rank $1", "rank", "(.*)")'
    staged = f'label_replace({ranked}, "worker", "stage $1 rank $2", "stage_rank", "([1-9][0-9]*) (.*)")'
    return f"max by (run, stage, rank, worker) ({staged})"


def _target(
    expr: str, legend: str = "", ref: str = "A", instant: bool = False, fmt: str = "time_series"
) -> dict[str, Any]:
    return {
        "datasource": PROM,
        "refId": ref,
        "expr": expr,
        "legendFormat": legend,
        "instant": instant,
        "range": not instant,
        "format": fmt,
    }


def _sql(sql: str, ref: str = "A") -> dict[str, Any]:
    return {
        "datasource": PG,
        "refId": ref,
        "rawQuery": True,
        "editorMode": "code",
        "format": "table",
        "rawSql": sql,
    }


class _Layout:
    """Assigns panel ids and grid positions row by row (24 columns)."""

    def __init__(self) -> None:
        self.panels: list[dict[str, Any]] = []
        self.y = 0
        self.x = 0
        self.row_h = 0
        self.next_id = 1

    def row(self, title: str) -> None:
        self._newline()
        self.panels.append(
            {
                "type": "row",
                "id": self._id(),
                "title": title,
                "collapsed": False,
                "gridPos": {"x": 0, "y": self.y, "w": 24, "h": 1},
                "panels": [],
            }
        )
        self.y += 1

    def add(self, panel: dict[str, Any], w: int, h: int) -> None:
        if self.x + w > 24:
            self._newline()
        panel["id"] = self._id()
        panel["gridPos"] = {"x": self.x, "y": self.y, "w": w, "h": h}
        self.panels.append(panel)
        self.x += w
        self.row_h = max(self.row_h, h)

    def _newline(self) -> None:
        self.y += self.row_h
        self.x = 0
        self.row_h = 0

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id - 1


def _panel(
    kind: str,
    title: str,
    targets: list[dict[str, Any]],
    description: str = "",
    unit: str = "short",
    **options: Any,
) -> dict[str, Any]:
    ds = targets[0]["datasource"]
    return {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": ds,
        "targets": targets,
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": options,
    }


def _p99_heatmap(stat: str, label: str) -> dict[str, Any]:
    expr = (
        f"histogram_quantile(0.99, sum by (layer, le) (max by (run, layer, le) "
        f"(rate(shadowd_call_{stat}_bucket{{{RL}}}{RI}))))"
    )
    return _panel(
        "heatmap",
        f"p99 per-call {label} by layer",
        [_target(expr, "{{layer}}")],
        f"One row per layer, colour = p99 of per-call {label} in each interval (rollup histograms).",
        calculate=False,
        yAxis={"axisPlacement": "left", "reverse": False},
        rowsFrame={"layout": "auto"},
        color={"mode": "scheme", "scheme": "Oranges", "scale": "exponential", "exponent": 0.5},
        cellGap=1,
        tooltip={"show": True, "yHistogram": False},
    )


def build() -> dict[str, Any]:
    """The dashboard as a dict (Grafana schema 39)."""
    lay = _Layout()

    lay.row("Verdict")
    lay.add(
        _panel(
            "table",
            "Verdict per run",
            [
                _target(
                    f"max by (run, candidate, verdict) "
                    f'(shadowd_readiness_verdict{{{R}, candidate=~"$candidate"}} == 1)',
                    instant=True,
                    fmt="table",
                )
            ],
            "Current verdict of the readiness judge (1 = current). "
            "GET /readiness answers 200 only for READY.",
            showHeader=True,
        ),
        w=8,
        h=7,
    )
    lay.add(
        _panel(
            "table",
            "Failing criteria (latest evaluation)",
            [_sql(FAILING_CRITERIA_SQL)],
            "From the collector's evaluations table (PostgreSQL datasource): each criterion of the latest "
            "stored evaluation that did not pass, with observed value and threshold.",
            showHeader=True,
        ),
        w=10,
        h=7,
    )
    lay.add(
        _panel(
            "table",
            "Verdict reasons (latest evaluation)",
            [_sql(REASONS_SQL)],
            "The reasons list of the latest stored evaluation.",
            showHeader=True,
        ),
        w=6,
        h=7,
    )
    lay.add(
        _panel(
            "state-timeline",
            "Verdict over time",
            [
                _target(
                    f'max by (run, verdict) (shadowd_readiness_verdict{{{R}, candidate=~"$candidate"}} == 1)',
                    "{{run}} {{verdict}}",
                )
            ],
            "Which verdict was current when.",
        ),
        w=16,
        h=6,
    )
    lay.add(
        _panel(
            "timeseries",
            "Readiness evaluations and verdict changes",
            [
                _target(
                    f"sum by (run) (increase(shadowd_readiness_evaluations_total{{{R}}}{RI}))",
                    "evaluations {{run}}",
                ),
                _target(
                    f"sum by (run) (increase(shadowd_readiness_verdict_changes_total{{{R}}}{RI}))",
                    "changes {{run}}",
                    ref="B",
                ),
            ],
        ),
        w=8,
        h=6,
    )

    lay.row("Numerical differences")
    lay.add(_p99_heatmap("max_abs", "max-abs"), w=12, h=9)
    lay.add(_p99_heatmap("rel_l2", "rel-L2"), w=12, h=9)
    lay.add(
        _panel(
            "heatmap",
            "Distribution of per-call rel-L2",
            [
                _target(
                    f"sum by (le) (max by (run, layer, le) (rate(shadowd_call_rel_l2_bucket{{{RL}}}{RI})))",
                    "{{le}}",
                    fmt="heatmap",
                )
            ],
            "All selected layers; buckets are octaves (powers of two).",
            calculate=False,
            yAxis={"axisPlacement": "left"},
            rowsFrame={"layout": "le"},
        ),
        w=12,
        h=8,
    )
    lay.add(
        _panel(
            "timeseries",
            "rel-L2 quantiles (all selected layers)",
            [
                _target(
                    f"histogram_quantile(0.5, sum by (le) (max by (run, layer, le) "
                    f"(rate(shadowd_call_rel_l2_bucket{{{RL}}}{RI}))))",
                    "p50",
                ),
                _target(
                    f"histogram_quantile(0.99, sum by (le) (max by (run, layer, le) "
                    f"(rate(shadowd_call_rel_l2_bucket{{{RL}}}{RI}))))",
                    "p99",
                    ref="B",
                ),
                _target(
                    f"histogram_quantile(0.999, sum by (le) (max by (run, layer, le) "
                    f"(rate(shadowd_call_rel_l2_bucket{{{RL}}}{RI}))))",
                    "p99.9",
                    ref="C",
                ),
            ],
            "The bf16 policy tolerance is rel-L2 0.016.",
        ),
        w=12,
        h=8,
    )

    lay.row("Exceedances and non-finite outputs")
    lay.add(
        _panel(
            "timeseries",
            "Exceedance rate by layer",
            [
                _target(
                    f"sum by (run, layer) (rate(shadowd_exceeded_calls_total{{{RL}}}{RI})) / on (run, layer) "
                    f"max by (run, layer) (rate(shadowd_layer_samples_total{{{RL}}}{RI}))",
                    "run {{run}} layer {{layer}}",
                )
            ],
            "Calls beyond the policy's tolerance (or failing hard) per call.",
            unit="percentunit",
        ),
        w=12,
        h=8,
    )
    lay.add(
        _panel(
            "timeseries",
            "Non-finite mismatch events",
            [
                _target(
                    f"sum by (run, layer) (increase(shadowd_nonfinite_mismatch_events_total{{{RL}}}{RI}))",
                    "run {{run}} layer {{layer}}",
                )
            ],
            "Calls where the candidate was non-finite where the baseline was finite: any is a hard failure.",
        ),
        w=12,
        h=8,
    )

    lay.row("Coverage")
    lay.add(
        _panel(
            "bargauge",
            "Samples per layer",
            [
                _target(
                    f"sum by (layer) (max by (run, layer) (shadowd_layer_samples_total{{{RL}}}))",
                    "{{layer}}",
                    instant=True,
                )
            ],
            "Calls compared per layer (rollups); a missing layer was never shadowed.",
            orientation="vertical",
            displayMode="basic",
        ),
        w=12,
        h=8,
    )
    lay.add(
        _panel(
            "bargauge",
            "Samples per shape bucket",
            [
                _target(
                    f"sum by (bucket) (max by (run, bucket) (shadowd_bucket_samples_total{{{R}}}))",
                    "{{bucket}}",
                    instant=True,
                )
            ],
            "bs = batch size bucket, t = draft tokens bucket, p = log2 prefix bucket, h = heads.",
            orientation="horizontal",
            displayMode="basic",
        ),
        w=8,
        h=8,
    )
    lay.add(
        _panel(
            "stat",
            "Layers covered",
            [
                _target(
                    f"count by (run) (max by (run, layer) (shadowd_layer_samples_total{{{R}}})) / on (run) "
                    f"max by (run) (shadowd_run_layers{{{R}}})",
                    "{{run}}",
                    instant=True,
                )
            ],
            "Share of the run's declared layers with at least one sample.",
            unit="percentunit",
        ),
        w=4,
        h=8,
    )

    lay.row("Ingest and producers")
    lay.add(
        _panel(
            "timeseries",
            "Ingest rate",
            [
                _target(f"sum by (run) (rate(shadowd_samples_total{{{R}}}{RI}))", "samples/s {{run}}"),
                _target(
                    f"sum by (run) (rate(shadowd_batches_total{{{R}}}{RI}))", "batches/s {{run}}", ref="B"
                ),
            ],
            "Stored samples and batches per second (per collector process, summed).",
            unit="ops",
        ),
        w=8,
        h=8,
    )
    lay.add(
        _panel(
            "timeseries",
            "Duplicate and rejected batches",
            [
                _target(
                    f"sum by (run) (rate(shadowd_duplicate_batches_total{{{R}}}{RI}))", "duplicates {{run}}"
                ),
                _target(
                    f"sum by (status) (rate(shadowd_rejected_batches_total{RI}))",
                    "rejected HTTP {{status}}",
                    ref="B",
                ),
            ],
            "Re-delivered batches (stored once) and batches answered with 4xx.",
            unit="ops",
        ),
        w=8,
        h=8,
    )
    lay.add(
        _panel(
            "timeseries",
            "Time since last ingest",
            [_target(f"time() - max by (run) (shadowd_last_ingest_timestamp_seconds{{{R}}})", "{{run}}")],
            "Alert ShadowdIngestStalled fires above 10 minutes.",
            unit="s",
        ),
        w=8,
        h=8,
    )
    lay.add(
        _panel(
            "timeseries",
            "Producer spool depth",
            [
                _target(
                    _by_worker("shadowd_producer_spool_depth"),
                    "run {{run}} {{worker}}",
                )
            ],
            "Batches waiting in each (pipeline stage, rank)'s on-disk spool.",
        ),
        w=8,
        h=8,
    )
    lay.add(
        _panel(
            "timeseries",
            "Producer drops, rejects, sequence gaps, device errors",
            [
                _target(
                    _by_worker("shadowd_producer_dropped_samples"),
                    "dropped, run {{run}} {{worker}}",
                ),
                _target(
                    _by_worker("shadowd_producer_rejected_samples"),
                    "rejected, run {{run}} {{worker}}",
                    ref="D",
                ),
                _target(
                    _by_worker("shadowd_producer_sequence_gaps"),
                    "gaps, run {{run}} {{worker}}",
                    ref="B",
                ),
                _target(
                    _by_worker("shadowd_producer_device_errors"),
                    "device errors, run {{run}} {{worker}}",
                    ref="C",
                ),
            ],
            "Running totals reported by producers, per (pipeline stage, rank): the legend names the stage above 0. "
            "Rejected: samples a producer gave up, invalid (a caller's bad bucket or layer) or in a batch the "
            "collector refused.",
        ),
        w=8,
        h=8,
    )
    lay.add(
        _panel(
            "timeseries",
            "Fallback and disabled candidates",
            [
                _target(
                    _by_worker("shadowd_producer_fallback"),
                    "on-mode fallback, run {{run}} {{worker}}",
                ),
                _target(
                    _by_worker("shadowd_producer_candidate_disabled"),
                    "candidate disabled, run {{run}} {{worker}}",
                    ref="B",
                ),
            ],
            "Producers that took the candidate out of the path (1), per (pipeline stage, rank).",
        ),
        w=8,
        h=8,
    )
    lay.add(
        _panel(
            "timeseries",
            "On mode: calls outside the verdict's shapes",
            [
                _target(
                    f"sum by (run) (shadowd_producer_on_uncovered_calls{{{R}}}) / clamp_min("
                    f"sum by (run) (shadowd_producer_on_covered_calls{{{R}}}) + "
                    f"sum by (run) (shadowd_producer_on_uncovered_calls{{{R}}}), 1)",
                    "run {{run}}",
                )
            ],
            "Share of on-mode calls on a shape bucket (batch, tree, prefix) the promotion gate's verdict did not "
            "cover: the baseline served them. Traffic the validate run never saw; validate those shapes to serve "
            "the candidate there.",
            unit="percentunit",
        ),
        w=8,
        h=8,
    )

    lay.row("Performance")
    lay.add(
        _panel(
            "timeseries",
            "Device time per call: candidate vs baseline",
            [
                _target(
                    f"sum by (impl) (max by (run, layer, impl) (rate(shadowd_device_time_seconds_total{{{RL}}}{RI}))) "
                    f"/ ignoring (impl) group_left "
                    f"sum (max by (run, layer) (rate(shadowd_timed_calls_total{{{RL}}}{RI})))",
                    "{{impl}}",
                )
            ],
            "Mean device time of timed calls (when producers report timing).",
            unit="s",
        ),
        w=16,
        h=8,
    )
    lay.add(
        _panel(
            "stat",
            "Baseline / candidate time",
            [
                _target(
                    f'sum (max by (run, layer) (shadowd_device_time_seconds_total{{{RL}, impl="baseline"}})) / '
                    f'sum (max by (run, layer) (shadowd_device_time_seconds_total{{{RL}, impl="candidate"}}))',
                    "speedup",
                    instant=True,
                )
            ],
            "Above 1: the candidate is faster (whole run).",
            unit="suffix:×",
        ),
        w=8,
        h=8,
    )

    lay.add(
        _panel(
            "timeseries",
            "Speculative accept length by hook mode",
            [
                _target(
                    f"max by (mode) (shadowd_spec_accept_length{{{R}}})",
                    "{{mode}}",
                )
            ],
            "SGLang's accept length (accepted tokens per request-step) while the hook was off, validating "
            "or serving the candidate: the end-to-end effect of switching on.",
        ),
        w=24,
        h=8,
    )

    def var(name: str, label: str, query: str) -> dict[str, Any]:
        return {
            "name": name,
            "label": label,
            "type": "query",
            "datasource": PROM,
            "query": {"query": query, "refId": f"var-{name}"},
            "definition": query,
            "refresh": 2,
            "multi": True,
            "includeAll": True,
            "sort": 3,
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        }

    return {
        "uid": "shadowd-overview",
        "title": "shadowd: shadow-mode kernel diffs",
        "description": "Numerical diffs of a candidate kernel against the baseline, per run and layer.",
        "tags": ["shadowd"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "timezone": "",
        "links": [],
        "annotations": {"list": []},
        "templating": {
            "list": [
                var("candidate", "Candidate", "label_values(shadowd_run_info, candidate)"),
                var("run", "Run", 'label_values(shadowd_run_info{candidate=~"$candidate"}, run)'),
                var("layer", "Layer", 'label_values(shadowd_layer_samples_total{run=~"$run"}, layer)'),
            ]
        },
        "panels": lay.panels,
    }


def main(argv: list[str]) -> int:
    """Write the dashboard (or, with ``--check``, fail when the file is stale)."""
    text = json.dumps(build(), indent=2, sort_keys=True) + "\n"
    if "--check" in argv:
        if DASHBOARD_PATH.read_text() != text:
            print(f"{DASHBOARD_PATH} is stale: run python {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    DASHBOARD_PATH.parent.mkdir(parents=True, exist_ok=True)
    DASHBOARD_PATH.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
