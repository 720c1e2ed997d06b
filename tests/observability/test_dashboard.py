"""The Grafana dashboard and its provisioning, checked without a Grafana server: generated file is fresh,
structure is sound, every query reads metrics the collector exposes; the SQL panels run on PostgreSQL."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import subprocess
import sys
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest
import yaml
from fastapi.testclient import TestClient

from tests.observability.conftest import DASHBOARDS, REPO, build_app, require_tool
from tests.observability.promql import (
    dashboard_targets,
    grafana_to_promql,
    metric_names,
    panels,
    record_names,
    rule_exprs,
    template_queries,
)
from tests.observability.seed import seed_run, store_evaluation

GRAFANA = DASHBOARDS / "grafana"


def _build_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("shadowd_dashboard_build", GRAFANA / "build.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def exposition(tmp_path_factory: pytest.TempPathFactory) -> Iterator[set[str]]:
    """Sample names in /metrics of a collector fed with the seeded run."""
    db = tmp_path_factory.mktemp("expo") / "shadowd.db"
    app = build_app(f"sqlite:///{db}")
    with TestClient(app) as client:
        run_id = seed_run(client, minutes=3)
        store_evaluation(app, run_id)
        text = client.get("/metrics").text
    yield set(re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)", text, re.M))


def _datasources() -> dict[str, str]:
    doc = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "shadowd.yml").read_text())
    return {d["uid"]: d["type"] for d in doc["datasources"]}


def test_generated_dashboard_is_fresh() -> None:
    p = subprocess.run([sys.executable, str(GRAFANA / "build.py"), "--check"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


def test_panel_ids_unique_and_grid_sound() -> None:
    all_panels = panels()
    ids = [p["id"] for p in all_panels]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    cells: set[tuple[int, int]] = set()
    for p in all_panels:
        g = p["gridPos"]
        assert g["w"] > 0 and g["h"] > 0 and g["x"] >= 0 and g["y"] >= 0, p["title"]
        assert g["x"] + g["w"] <= 24, f"{p['title']} is wider than the grid"
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, f"{p['title']} overlaps another panel"
        cells |= mine


def test_datasource_references_resolve() -> None:
    sources = _datasources()
    for p in panels():
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] in sources, p["title"]
        for t in p["targets"]:
            ds = t["datasource"]
            assert sources.get(ds["uid"]) == ds["type"], f"{p['title']}: {ds}"
            assert ("expr" in t) == (ds["type"] == "prometheus"), p["title"]
            assert ("rawSql" in t) == (ds["type"] != "prometheus"), p["title"]
    for v in template_queries():
        assert sources.get(v["datasource"]["uid"]) == "prometheus"


def test_template_variables_and_key_panels() -> None:
    assert {v["name"] for v in template_queries()} == {"run", "candidate", "layer"}
    titles = {p["title"] for p in panels()}
    build = _build_module()
    assert set(build.KEY_PANELS) <= titles
    for needed in (
        "Failing criteria (latest evaluation)",
        "Duplicate and rejected batches",
        "Producer drops, rejects, sequence gaps, device errors",
        "Distribution of per-call rel-L2",
    ):
        assert needed in titles
    prom = [t["expr"] for _, t in dashboard_targets()]
    for t in prom:
        if "shadowd_run_info" not in t and "shadowd_rejected_batches" not in t:
            assert "$run" in t, f"query ignores the run variable: {t}"


def test_every_query_reads_exposed_metrics(exposition: set[str]) -> None:
    records = record_names()
    exprs: list[tuple[str, str]] = [(title, t["expr"]) for title, t in dashboard_targets()]
    exprs += [(f"variable {v['name']}", v["definition"]) for v in template_queries()]
    exprs += rule_exprs()
    for where, expr in exprs:
        names = metric_names(expr)
        assert names or re.search(r"\bup\{", expr), f"{where}: reads no shadowd metric"
        unknown = {n for n in names if n not in exposition and n not in records}
        assert not unknown, f"{where}: {sorted(unknown)} not in the collector's exposition"


def test_producer_legends_name_the_stage_only_above_zero(tmp_path: Any) -> None:
    """The producer panels' queries, evaluated by promtool over series of stages 0 and 1: ``worker`` is ``rank R`` for
    stage 0 (every launch without --pp-size) and ``stage S rank R`` above it, and the values stay each series' own."""
    promtool = require_tool("promtool")
    exprs = [grafana_to_promql(t["expr"]) for _, t in dashboard_targets() if "{{worker}}" in t.get("legendFormat", "")]
    assert len(exprs) == 7, exprs
    workers = {("0", "0"): ("rank 0", 2), ("1", "0"): ("stage 1 rank 0", 5), ("0", "1"): ("rank 1", 7)}
    tests = []
    for expr in exprs:
        (metric,) = metric_names(expr)
        series = [{"series": f'{metric}{{job="shadowd",instance="c:8787",run="3",stage="{st}",rank="{rk}"}}',
                   "values": f"{v}x10"} for (st, rk), (_, v) in workers.items()]
        want = [{"labels": f'{{run="3",stage="{st}",rank="{rk}",worker="{w}"}}', "value": v}
                for (st, rk), (w, v) in workers.items()]
        tests.append({"interval": "1m", "input_series": series,
                      "promql_expr_test": [{"expr": expr, "eval_time": "5m", "exp_samples": want}]})
    spec = tmp_path / "legends_test.yml"
    spec.write_text(yaml.safe_dump({"rule_files": [], "evaluation_interval": "1m", "tests": tests}))
    p = subprocess.run([promtool, "test", "rules", str(spec)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "SUCCESS" in p.stdout, p.stdout + p.stderr


def test_the_on_mode_coverage_panel_is_the_share_of_calls_outside_the_verdict(tmp_path: Any) -> None:
    """The panel's query, evaluated by promtool: per run, uncovered calls over all on-mode calls of its ranks (two
    ranks: 30 + 10 uncovered of 100 + 60 covered → 0.2); a run with no on-mode call yet reads 0, not NaN."""
    promtool = require_tool("promtool")
    (expr,) = [grafana_to_promql(t["expr"]) for title, t in dashboard_targets()
               if title == "On mode: calls outside the verdict's shapes"]
    figures = {("3", "0"): (100, 30), ("3", "1"): (60, 10), ("4", "0"): (0, 0)}
    series = []
    for (run, rank), (cov, unc) in figures.items():
        for metric, v in (("shadowd_producer_on_covered_calls", cov), ("shadowd_producer_on_uncovered_calls", unc)):
            series.append({"series": f'{metric}{{job="shadowd",instance="c:8787",run="{run}",stage="0",rank="{rank}"}}',
                           "values": f"{v}x10"})
    want = [{"labels": '{run="3"}', "value": 0.2}, {"labels": '{run="4"}', "value": 0}]
    spec = tmp_path / "coverage_test.yml"
    spec.write_text(yaml.safe_dump({"rule_files": [], "evaluation_interval": "1m", "tests": [
        {"interval": "1m", "input_series": series,
         "promql_expr_test": [{"expr": expr, "eval_time": "5m", "exp_samples": want}]}]}))
    p = subprocess.run([promtool, "test", "rules", str(spec)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "SUCCESS" in p.stdout, p.stdout + p.stderr


def test_provisioning_matches_compose() -> None:
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    mounts = {
        v.split(":")[1]: v.split(":")[0]
        for v in compose["services"]["grafana"]["volumes"]
        if v.startswith("./")
    }
    provider = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "shadowd.yml").read_text())[
        "providers"
    ][0]
    src = mounts[provider["options"]["path"]]
    assert (REPO / src / "shadowd.json").is_file()
    assert mounts["/etc/grafana/provisioning/datasources"] == "./dashboards/grafana/provisioning/datasources"
    sources = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "shadowd.yml").read_text())[
        "datasources"
    ]
    services = set(compose["services"])
    for d in sources:
        host = d["url"].split("//")[-1].split(":")[0]
        assert host in services, f"datasource {d['name']} points at {host}, not a compose service"


def _sql_targets() -> list[tuple[str, str]]:
    return [(p["title"], t["rawSql"]) for p in panels() for t in p.get("targets", []) if "rawSql" in t]


def test_sql_panels_run_on_postgresql(fresh_pg: str) -> None:
    """The failing-criteria and reasons panels, run as Grafana runs them ($run = list of quoted ids)."""
    from sqlalchemy import text

    app = build_app(fresh_pg)
    with TestClient(app) as client:
        run_id = seed_run(client, minutes=2)
        store_evaluation(app, run_id, {"verdict": "INSUFFICIENT_DATA", "reasons": ["old"], "criteria": []})
        store_evaluation(app, run_id)  # the latest one counts
        engine = app.state.shadowd.engine
        results: dict[str, list[Any]] = {}
        with engine.connect() as conn:
            for title, sql in _sql_targets():
                results[title] = [
                    dict(r)
                    for r in conn.execute(text(sql.replace("$run", f"'{run_id}','999999'"))).mappings()
                ]
    failing = results["Failing criteria (latest evaluation)"]
    assert {r["criterion"] for r in failing} == {"no_nonfinite_mismatch", "exceeding_step_rate_upper"}
    assert all(r["verdict"] == "NOT_READY" and r["candidate"] == "kdtree-verify" for r in failing)
    reasons = results["Verdict reasons (latest evaluation)"]
    assert len(reasons) == 2 and "old" not in {r["reason"] for r in reasons}
    assert json.dumps(failing, default=str)


def _promtool_eval(tmp_path: Any, series: dict[str, str], checks: list[tuple[str, list[tuple[str, float]]]]) -> None:
    """Evaluate PromQL over ``series`` (promtool's notation, one sample a minute) at 10m with ``promtool test
    rules``: each check is (expr, [(labels, value)]), the values compared to 7 significant digits; Grafana's
    variables as with everything selected, the rate interval 5m."""
    promtool = require_tool("promtool")
    (tmp_path / "none.yml").write_text("groups: []\n")
    cases = []
    for expr, exp in checks:
        # promtool compares exactly: compare round(value * scale) instead, scale putting the values near 1e6
        scale = 10.0 ** (6 - math.floor(math.log10(max(abs(v) for _, v in exp))))
        cases.append({
            "expr": f"round({scale!r} * ({grafana_to_promql(expr.replace('$__rate_interval', '5m'))}))",
            "eval_time": "10m",
            "exp_samples": [{"labels": labels, "value": float(round(v * scale))} for labels, v in exp],
        })
    tests = [
        {
            "interval": "1m",
            "input_series": [{"series": s, "values": v} for s, v in series.items()],
            "promql_expr_test": cases,
        }
    ]
    (tmp_path / "test.yml").write_text(yaml.safe_dump({"rule_files": ["none.yml"], "tests": tests}))
    p = subprocess.run([promtool, "test", "rules", "test.yml"], cwd=tmp_path, capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr


def _expr(title: str) -> str:
    return next(t["expr"] for panel, t in dashboard_targets() if panel == title)


def test_per_layer_and_per_run_panels_add_up(tmp_path: Any) -> None:
    """Two collectors export the same rollup series (max over them), and layers and runs add up: the mean
    device time per call is all selected layers' time over all their calls (not the slowest layer's time over
    the busiest layer's calls), the whole-run speedup, the samples per layer and the rel-L2 distribution sum the
    selected runs."""
    series: dict[str, str] = {}
    for inst in ("a", "b"):
        for run, layer, calls, cand, base, samples in (
            ("1", "0", "0+6000x10", "0+0.24x10", "0+0.33x10", "100x10"),  # 40 µs and 55 µs per call
            ("1", "1", "0+600x10", "0+0.6x10", "0+0.66x10", "100x10"),  # 1 ms and 1.1 ms per call, 1 call in 10
            ("2", "0", "1000x10", "10x10", "1x10", "50x10"),  # another run, stopped: no rate, its totals count
        ):
            lab = f'instance="{inst}",run="{run}",layer="{layer}"'
            series[f"shadowd_timed_calls_total{{{lab}}}"] = calls
            series[f'shadowd_device_time_seconds_total{{{lab},impl="candidate"}}'] = cand
            series[f'shadowd_device_time_seconds_total{{{lab},impl="baseline"}}'] = base
            series[f"shadowd_layer_samples_total{{{lab}}}"] = samples
        for run, per_min in (("1", 60), ("2", 120)):  # two runs serving at once: 1 and 2 calls/s below 2^-7
            for le in ("0.0078125", "+Inf"):
                series[f'shadowd_call_rel_l2_bucket{{instance="{inst}",run="{run}",layer="0",le="{le}"}}'] = (
                    f"0+{per_min}x10"
                )
    _promtool_eval(
        tmp_path,
        series,
        [
            (
                _expr("Device time per call: candidate vs baseline"),
                [('{impl="candidate"}', 0.84 / 6600), ('{impl="baseline"}', 0.99 / 6600)],
            ),
            (_expr("Baseline / candidate time"), [("{}", (3.3 + 6.6 + 1) / (2.4 + 6 + 10))]),
            (_expr("Samples per layer"), [('{layer="0"}', 150), ('{layer="1"}', 100)]),
            (_expr("Distribution of per-call rel-L2"), [('{le="0.0078125"}', 3), ('{le="+Inf"}', 3)]),
        ],
    )
