"""A real Prometheus (loopback) scrapes a real collector fed with samples, evaluates rules.yml and sends
alerts to a real Alertmanager: every PromQL expression of the dashboard and the rules runs without
error and the key panels return data."""

from __future__ import annotations

import math
import time
from typing import Any

import httpx
import pytest

from tests.observability.conftest import Collector
from tests.observability.promql import dashboard_targets, grafana_to_promql, rule_exprs, template_queries


def _query(prom: str, expr: str, instant: bool = True) -> list[dict[str, Any]]:
    if instant:
        r = httpx.get(f"{prom}/api/v1/query", params={"query": expr}, timeout=10)
    else:
        now = time.time()
        r = httpx.get(
            f"{prom}/api/v1/query_range",
            params={"query": expr, "start": now - 60, "end": now, "step": "2s"},
            timeout=10,
        )
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", f"{expr}\n-> {body}"
    return body["data"]["result"]  # type: ignore[no-any-return]


def _finite_values(result: list[dict[str, Any]]) -> list[float]:
    out = []
    for series in result:
        values = series.get("values") or [series["value"]]
        out += [float(v) for _, v in values if math.isfinite(float(v))]
    return out


def test_every_rule_expression_runs(prometheus: str) -> None:
    for _name, expr in rule_exprs():
        _query(prometheus, expr)  # asserts success


def test_rules_loaded_without_errors(prometheus: str) -> None:
    groups = httpx.get(f"{prometheus}/api/v1/rules", timeout=10).json()["data"]["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert len(rules) == len(rule_exprs())
    bad = [(r["name"], r.get("lastError")) for r in rules if r.get("health") == "err"]
    assert not bad


def test_every_dashboard_query_runs_and_key_panels_have_data(prometheus: str, collector: Collector) -> None:
    from tests.observability.test_dashboard import _build_module

    key = set(_build_module().KEY_PANELS)
    with_data: set[str] = set()
    for title, target in dashboard_targets():
        expr = grafana_to_promql(target["expr"])
        result = _query(prometheus, expr, instant=target["instant"])
        if _finite_values(result):
            with_data.add(title)
    assert key - with_data == set(), "key panels without data"
    print("panels without data:", sorted({t for t, _ in dashboard_targets()} - with_data))


def test_template_variables_resolve(prometheus: str, collector: Collector) -> None:
    for var in template_queries():
        q = var["definition"]
        selector, label = q[len("label_values(") : -1].rsplit(",", 1)
        selector = grafana_to_promql(selector.strip())
        r = httpx.get(
            f"{prometheus}/api/v1/label/{label.strip()}/values", params={"match[]": selector}
        ).json()
        assert r["status"] == "success" and r["data"], f"variable {var['name']}: {r}"
    runs = httpx.get(f"{prometheus}/api/v1/label/run/values", params={"match[]": "shadowd_run_info"}).json()
    assert str(collector.run_id) in runs["data"]


def test_nonfinite_alert_reaches_alertmanager(
    prometheus: str, alertmanager: str, collector: Collector
) -> None:
    deadline = time.monotonic() + 30
    names: set[str] = set()
    while time.monotonic() < deadline:
        alerts = httpx.get(f"{alertmanager}/api/v2/alerts", timeout=5).json()
        names = {a["labels"]["alertname"] for a in alerts}
        if "ShadowdNonFiniteMismatch" in names:
            alert = next(a for a in alerts if a["labels"]["alertname"] == "ShadowdNonFiniteMismatch")
            assert alert["labels"]["run"] == str(collector.run_id)
            assert "threshold 0" in alert["annotations"]["summary"]
            return
        time.sleep(0.5)
    pytest.fail(f"ShadowdNonFiniteMismatch never reached Alertmanager (saw {sorted(names)})")


def test_a_layers_first_nonfinite_call_shows_in_the_panel(prometheus: str, collector: Collector) -> None:
    """The dashboard's non-finite panel (increase over the rate interval, as Grafana runs it) shows a layer's
    first non-finite call: the layer's counter was scraped at 0 before it, so the event is an increase."""
    from tests.factories import make_batch
    from tests.observability.seed import NUM_LAYERS

    layer = 3  # the seeded run's non-finite call is on layer 1; live traffic has none
    panel = "Non-finite mismatch events"
    expr = next(grafana_to_promql(t["expr"]) for title, t in dashboard_targets() if title == panel)
    n = NUM_LAYERS * 4
    b = make_batch(n, num_layers=NUM_LAYERS, producer="p-first-nonfinite", ts0=time.time() - 1, seed=7,
                   cand_nonfinite=[2 if i == layer else 0 for i in range(n)])
    assert collector.client.post(f"/v1/runs/{collector.run_id}/samples", json=b).status_code == 200
    deadline = time.monotonic() + 20
    seen: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        seen = [s for s in _query(prometheus, expr) if s["metric"].get("layer") == str(layer)]
        if any(float(s["value"][1]) > 0 for s in seen):
            return
        time.sleep(0.5)
    pytest.fail(f"layer {layer}'s first non-finite call never showed in the panel: {seen}")
