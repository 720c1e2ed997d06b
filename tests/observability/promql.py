"""The PromQL of the dashboard and of the rules, as the tests execute it."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

__all__ = [
    "DASHBOARD",
    "RULES",
    "dashboard_targets",
    "grafana_to_promql",
    "metric_names",
    "panels",
    "record_names",
    "rule_exprs",
    "template_queries",
]

DASHBOARDS = Path(__file__).resolve().parents[2] / "dashboards"
DASHBOARD = DASHBOARDS / "grafana" / "dashboards" / "shadowd.json"
RULES = DASHBOARDS / "prometheus" / "rules.yml"

_VARS = {
    "$__rate_interval": "20s",
    "$__interval": "5s",
    "$__range": "5m",
    "$run": ".*",
    "$layer": ".*",
    "$candidate": ".*",
}


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels() -> list[dict[str, Any]]:
    """All panels, rows included, in order."""
    out = []
    for p in _dashboard()["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def dashboard_targets() -> list[tuple[str, dict[str, Any]]]:
    """(panel title, target) for every Prometheus query of the dashboard."""
    return [(p["title"], t) for p in panels() for t in p.get("targets", []) if "expr" in t]


def template_queries() -> list[dict[str, Any]]:
    return [v for v in _dashboard()["templating"]["list"] if v.get("type") == "query"]


def grafana_to_promql(expr: str) -> str:
    """Substitute Grafana's variables as Grafana would with every value selected."""
    for k in sorted(_VARS, key=len, reverse=True):
        expr = expr.replace(k, _VARS[k])
    # ($1, $2: label_replace's references to its regex groups, which Grafana leaves as they are)
    assert not re.search(r"\$(?!\d)", expr), f"unknown variable in {expr!r}"
    return expr


def _rules() -> list[dict[str, Any]]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def rule_exprs() -> list[tuple[str, str]]:
    """(record or alert name, expr) of every rule."""
    return [(r.get("alert") or r["record"], r["expr"]) for r in _rules()]


def record_names() -> set[str]:
    return {r["record"] for r in _rules() if "record" in r}


def metric_names(expr: str) -> set[str]:
    """The shadowd metric and recording-rule names an expression reads."""
    return set(re.findall(r"\bshadowd[_:][A-Za-z0-9_:]*", expr))
