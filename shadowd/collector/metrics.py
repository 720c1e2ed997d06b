"""Prometheus metrics of the collector (all names start with ``shadowd_``).

Two kinds, on one injectable registry:

* process counters updated at ingest (samples, batches, duplicates, rejections, non-finite
  and exceeding calls) — per collector process;
* series read from the database at scrape time (per-layer histograms of per-call
  max-abs / rel-L2 / cosine difference, coverage per layer and per shape bucket, device time,
  producer health of the latest producer of each (pipeline stage, rank), last-ingest time) — so they survive restarts,
  cost nothing per sample, and agree between two collectors sharing one database (aggregate those
  with ``max``, not ``sum``).

Labels are bounded: ``run`` (run id), ``candidate``, ``layer``, ``stage``, ``rank``, ``bucket`` — never
per step or per request; only runs with an ingest in the last ``metrics_active_hours``.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import Engine, select

from shadowd.collector import tables as t
from shadowd.collector.queries import runs_for_metrics, speculative_of
from shadowd.judge.bins import NONFINITE_BIN, OCTAVE_SUFFIX, ZERO_BIN

__all__ = ["DECLARE_LAYERS_MAX", "HIST_EXPORTS", "CollectorMetrics", "RollupExporter", "cell_bucket_label"]

log = logging.getLogger("shadowd.collector")

#: exported per-call histograms: stat -> (metric name, help, octave exponents of the le edges)
HIST_EXPORTS: dict[str, tuple[str, str, range]] = {
    "max_abs": ("shadowd_call_max_abs", "Per-call max |candidate - baseline|", range(-24, 5)),
    "rel_l2": ("shadowd_call_rel_l2", "Per-call ||candidate - baseline|| / ||baseline||", range(-20, 3)),
    "cos_diff": ("shadowd_call_cos_diff", "Per-call sum (c-b)^2 / sum (c^2+b^2)", range(-40, 1, 2)),
}
#: layers whose counters :meth:`CollectorMetrics.declare_run` makes at 0 (models have ~100; a run declaring
#: 100 000 layers must not create as many series before sending anything)
DECLARE_LAYERS_MAX = 1024
_SUM_COLUMN = {"max_abs": "sum_max_abs", "rel_l2": "sum_rel_l2", "cos_diff": "sum_cos_diff"}


def cell_bucket_label(cell: dict[str, Any]) -> str:
    """A shape bucket as one label value: bs<=B,t<=T,L<2^P,h=H."""
    return f"bs{cell['bs_bucket']}-t{cell['t_bucket']}-p{cell['prefix_bucket']}-h{cell['heads']}"


class CollectorMetrics:
    """Process counters and gauges, registered on ``registry``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.samples = Counter("shadowd_samples", "Samples stored", ["run"], registry=registry)
        self.batches = Counter("shadowd_batches", "Batches stored", ["run"], registry=registry)
        self.duplicates = Counter("shadowd_duplicate_batches", "Batches delivered again and not re-stored",
                                  ["run"], registry=registry)
        self.rejected = Counter("shadowd_rejected_batches", "Batches rejected, by HTTP status", ["status"],
                                registry=registry)
        self.nonfinite = Counter("shadowd_nonfinite_mismatch_events",
                                 "Calls where the candidate was non-finite where the baseline was finite",
                                 ["run", "layer"], registry=registry)
        self.exceeded = Counter("shadowd_exceeded_calls", "Calls beyond tolerance or failing hard",
                                ["run", "layer"], registry=registry)
        self.verdict = Gauge("shadowd_readiness_verdict", "1 for the run's current verdict, 0 for the others",
                             ["run", "candidate", "verdict"], registry=registry)
        self.verdict_changes = Counter("shadowd_readiness_verdict_changes", "Changes of a run's verdict",
                                       ["run"], registry=registry)
        self.evaluations = Counter("shadowd_readiness_evaluations", "Stored readiness evaluations", ["run"],
                                   registry=registry)
        self.clock_offset = Gauge(
            "shadowd_producer_clock_offset_seconds",
            "Collector receive time minus the producer's send stamp of its latest batch (positive: the producer's "
            "clock is behind, plus the network's time)", ["run", "stage", "rank"], registry=registry)

    def declare_run(self, run_id: int, num_layers: int) -> None:
        """Make a run's per-run and per-layer event counters at 0 before its first batch (at its registration, and
        for the active runs when the collector starts): ``increase()`` and ``rate()`` see nothing of a series whose
        first scraped value is already its first event. At most ``DECLARE_LAYERS_MAX`` layers."""
        run = str(run_id)
        self.samples.labels(run)
        self.batches.labels(run)
        for layer in range(min(int(num_layers), DECLARE_LAYERS_MAX)):
            self.exceeded.labels(run, str(layer))
            self.nonfinite.labels(run, str(layer))

    def observe_ingest(self, run_id: int, n: int, layers: Any, exceeded: Any, cand_nonfinite: Any) -> None:
        run = str(run_id)
        self.samples.labels(run).inc(n)
        self.batches.labels(run).inc()
        exceeded_by, nonfinite_by = _count_by(layers, exceeded), _count_by(layers, cand_nonfinite)
        # every layer the batch reaches gets both series, at 0 until its first event: increase() and rate() see
        # nothing of a series born with its first event (the dashboard's panels, the tolerance alert)
        for layer in set(layers.tolist()):
            self.exceeded.labels(run, str(layer)).inc(exceeded_by.get(layer, 0))
            self.nonfinite.labels(run, str(layer)).inc(nonfinite_by.get(layer, 0))

    def observe_clock(self, run_id: int, rank: int, offset_s: float, stage: int = 0) -> None:
        """A (stage, rank)'s clock offset, from the send stamp of the batch just received
        (``shadowd.wire.SENT_AT_HEADER``)."""
        self.clock_offset.labels(str(run_id), str(stage), str(rank)).set(offset_s)

    def set_verdict(self, run_id: int, candidate: str, verdict: str, changed: bool, stored: bool = True) -> None:
        """The run's verdict gauges; ``stored``: an evaluation was stored (counted), not a pass whose unchanged
        evidence kept the previous one."""
        run = str(run_id)
        for v in ("READY", "NOT_READY", "INSUFFICIENT_DATA"):
            self.verdict.labels(run, candidate, v).set(1.0 if v == verdict else 0.0)
        if stored:
            self.evaluations.labels(run).inc()
        if changed:
            self.verdict_changes.labels(run).inc()


def _count_by(layers: Any, mask: Any) -> dict[int, int]:
    out: dict[int, int] = defaultdict(int)
    for layer in layers[mask].tolist():
        out[layer] += 1
    return out


class RollupExporter(Collector):
    """Series computed from the rollup tables at scrape time."""

    def __init__(self, engine: Engine, active_hours: float) -> None:
        self.engine = engine
        self.active_s = active_hours * 3600.0

    def describe(self) -> Iterator[Metric]:
        return iter(())  # computed per scrape; nothing to describe up front

    def collect(self) -> Iterator[Metric]:
        try:
            yield from self._collect()
        except Exception:  # the database may be restarting; a scrape must not fail with it
            log.exception("rollup metrics unavailable")

    def _collect(self) -> Iterator[Metric]:
        runs = runs_for_metrics(self.engine, time.time() - self.active_s)
        ids = [r["id"] for r in runs]
        if not ids:
            return
        with self.engine.connect() as conn:
            cells = [dict(r) for r in conn.execute(select(t.cells).where(t.cells.c.run_id.in_(ids))).mappings()]
            hists = conn.execute(
                select(t.hists.c.run_id, t.hists.c.layer, t.hists.c.stat, t.hists.c.bin, t.hists.c["count"])
                .where(t.hists.c.run_id.in_(ids) & t.hists.c.stat.in_([s + OCTAVE_SUFFIX for s in HIST_EXPORTS])
                       & (t.hists.c.layer >= 0))
            ).all()
            prods = [dict(r) for r in conn.execute(select(t.producers).where(t.producers.c.run_id.in_(ids)))
                     .mappings()]
        yield from self._histograms(cells, hists)
        yield from self._coverage(runs, cells)
        yield from self._producers(prods)
        # from the database, not the process: after a restart (or on another collector) a stalled run still
        # shows its last batch, so ShadowdIngestStalled can fire
        last = GaugeMetricFamily("shadowd_last_ingest_timestamp_seconds", "Unix time of the last stored batch",
                                 labels=["run"])
        for r in runs:
            if r["last_ingest_at"] is not None:  # (a run with only stats-only batches has stored no batch of samples)
                last.add_metric([str(r["id"])], float(r["last_ingest_at"]))
        yield last

    def _histograms(self, cells: list[dict[str, Any]], hists: Sequence[Any]) -> Iterator[Metric]:
        sums: dict[tuple[int, int, str], float] = defaultdict(float)
        for c in cells:
            for stat, col in _SUM_COLUMN.items():
                sums[(c["run_id"], c["layer"], stat)] += c[col]
        bins: dict[tuple[int, int, str], list[tuple[int, int]]] = defaultdict(list)
        for run_id, layer, stat, b, count in hists:  # per-layer octave bins
            bins[(run_id, layer, stat.removesuffix(OCTAVE_SUFFIX))].append((b, count))
        for stat, (name, doc, exps) in HIST_EXPORTS.items():
            fam = HistogramMetricFamily(name, doc, labels=["run", "layer"])
            for (run_id, layer, s), items in sorted(bins.items()):
                if s != stat:
                    continue
                buckets = []
                for k in exps:
                    edge = k - 1  # octave bins b <= k-1 have upper edge <= 2^k
                    buckets.append((f"{2.0 ** k:.6g}", float(sum(c for b, c in items
                                                                   if b == ZERO_BIN or (b != NONFINITE_BIN
                                                                                        and b <= edge)))))
                total = float(sum(c for _, c in items))
                buckets.append(("+Inf", total))
                fam.add_metric([str(run_id), str(layer)], buckets, sums[(run_id, layer, stat)])
            yield fam

    def _coverage(self, runs: list[dict[str, Any]], cells: list[dict[str, Any]]) -> Iterator[Metric]:
        per_layer = CounterMetricFamily("shadowd_layer_samples", "Samples per layer (coverage)",
                                        labels=["run", "layer"])
        per_bucket = CounterMetricFamily("shadowd_bucket_samples", "Samples per shape bucket (coverage)",
                                         labels=["run", "bucket"])
        dev = CounterMetricFamily("shadowd_device_time_seconds", "Device time of timed calls, by implementation",
                                  labels=["run", "layer", "impl"])
        timed = CounterMetricFamily("shadowd_timed_calls", "Calls with device time reported",
                                    labels=["run", "layer"])
        layer_acc: dict[tuple[int, int], dict[str, float]] = defaultdict(lambda: defaultdict(float))
        bucket_acc: dict[tuple[int, str], float] = defaultdict(float)
        for c in cells:
            a = layer_acc[(c["run_id"], c["layer"])]
            for k in ("n", "n_timed", "sum_cand_us", "sum_base_us"):
                a[k] += c[k]
            bucket_acc[(c["run_id"], cell_bucket_label(c))] += c["n"]
        for (run_id, layer), a in sorted(layer_acc.items()):
            per_layer.add_metric([str(run_id), str(layer)], a["n"])
            if a["n_timed"]:
                timed.add_metric([str(run_id), str(layer)], a["n_timed"])
                dev.add_metric([str(run_id), str(layer), "candidate"], a["sum_cand_us"] * 1e-6)
                dev.add_metric([str(run_id), str(layer), "baseline"], a["sum_base_us"] * 1e-6)
        for (run_id, bucket), n in sorted(bucket_acc.items()):
            per_bucket.add_metric([str(run_id), bucket], n)
        yield from (per_layer, per_bucket, dev, timed)
        info = GaugeMetricFamily("shadowd_run_info", "Runs being exported (value 1)",
                                 labels=["run", "run_key", "candidate", "model"])
        layers = GaugeMetricFamily("shadowd_run_layers", "Layers the run declared", labels=["run"])
        for r in runs:
            info.add_metric([str(r["id"]), r["run_key"], r["candidate_name"], r["model"]], 1.0)
            layers.add_metric([str(r["id"])], float(r["num_layers"]))
        yield from (info, layers)

    def _producers(self, prods: list[dict[str, Any]]) -> Iterator[Metric]:
        specs = {
            "spool_depth": ("shadowd_producer_spool_depth", "Batches waiting in a producer's on-disk spool"),
            "dropped": ("shadowd_producer_dropped_samples", "Samples a producer dropped (spool bound hit)"),
            "rejected": ("shadowd_producer_rejected_samples",
                         "Samples a producer gave up: invalid (left out of their batch) or refused by the collector"),
            "fallback": ("shadowd_producer_fallback", "1 when an on-mode producer fell back to the baseline"),
            "disabled": ("shadowd_producer_candidate_disabled", "1 when a producer disabled its candidate"),
            "gaps": ("shadowd_producer_sequence_gaps", "Batches missing from a producer's sequence"),
            "device_errors": ("shadowd_producer_device_errors", "Kernel-side index errors a producer saw"),
            "on_covered_calls": ("shadowd_producer_on_covered_calls",
                                 "On-mode calls on a shape bucket the verdict covers (the candidate may serve them)"),
            "on_uncovered_calls": ("shadowd_producer_on_uncovered_calls",
                                   "On-mode calls on a shape bucket the verdict does not cover (the baseline served "
                                   "them)"),
        }
        by_run: dict[int, list[dict[str, Any]]] = defaultdict(list)
        for p in prods:
            by_run[p["run_id"]].append(p)
        accept = GaugeMetricFamily("shadowd_spec_accept_length",
                                   "SGLang's speculative accept length (tokens per request-step) per hook mode",
                                   labels=["run", "mode"])
        passes = CounterMetricFamily("shadowd_spec_verify_passes", "Verify passes counted per hook mode",
                                     labels=["run", "mode"])
        for run_id, ps in sorted(by_run.items()):
            for mode, s in speculative_of(ps).items():
                accept.add_metric([str(run_id), mode], s["accept_length"])
                passes.add_metric([str(run_id), mode], s["verify_passes"])
        yield from (accept, passes)
        # a rank has a new producer after each restart: its latest (the one that started last) is the rank's
        # state now; an earlier process's figures (a candidate it disabled, say) would otherwise stay forever.
        # Pipeline stages share TP ranks while both live: each (stage, rank) has its own latest producer
        latest: dict[tuple[int, int, int], dict[str, Any]] = {}
        for p in sorted(prods, key=lambda p: (p["first_seen"], p["last_seen"])):
            latest[(p["run_id"], int(p.get("stage") or 0), p["rank"])] = p
        for col, (name, doc) in specs.items():
            fam = GaugeMetricFamily(name, doc, labels=["run", "stage", "rank"])
            for (run_id, stage, rank), p in sorted(latest.items()):
                fam.add_metric([str(run_id), str(stage), str(rank)], float(p[col]))
            yield fam
