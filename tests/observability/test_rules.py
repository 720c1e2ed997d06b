"""Prometheus rules and Alertmanager config: promtool / amtool checks and the rule unit tests."""

from __future__ import annotations

import subprocess

import yaml

from shadowd.judge.policy import DTYPE_DEFAULTS
from tests.observability.conftest import PROM_DIR, require_tool


def _run(cmd: list[str]) -> str:
    p = subprocess.run(cmd, cwd=PROM_DIR, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, f"{' '.join(cmd)} failed:\n{p.stdout}\n{p.stderr}"
    return p.stdout + p.stderr


def _groups() -> list[dict]:
    groups: list[dict] = yaml.safe_load((PROM_DIR / "rules.yml").read_text())["groups"]
    return groups


def _alerts() -> list[dict]:
    return [r for g in _groups() for r in g["rules"] if "alert" in r]


def test_promtool_check_rules() -> None:
    promtool = require_tool("promtool")
    assert "SUCCESS" in _run([promtool, "check", "rules", "rules.yml"])


def test_promtool_check_config() -> None:
    promtool = require_tool("promtool")
    assert "SUCCESS" in _run([promtool, "check", "config", "prometheus.yml"])


def test_promtool_test_rules() -> None:
    promtool = require_tool("promtool")
    assert "SUCCESS" in _run([promtool, "test", "rules", "rules_test.yml"])


def test_amtool_check_config() -> None:
    amtool = require_tool("amtool")
    assert "SUCCESS" in _run([amtool, "check-config", "alertmanager.yml"])


def test_every_alert_fires_and_stays_quiet_in_the_unit_tests() -> None:
    tests = yaml.safe_load((PROM_DIR / "rules_test.yml").read_text())["tests"]
    fired: set[str] = set()
    quiet: set[str] = set()
    for case in tests:
        for a in case.get("alert_rule_test", []):
            (fired if a.get("exp_alerts") else quiet).add(a["alertname"])
    names = {a["alert"] for a in _alerts()}
    assert names - fired == set(), "alerts never made to fire"
    assert names - quiet == set(), "alerts never shown quiet"


def test_every_alert_states_observed_value_and_threshold() -> None:
    for a in _alerts():
        summary = a["annotations"]["summary"]
        assert "$value" in summary or "$labels.verdict" in summary, a["alert"]
        assert "threshold" in summary or "expected" in summary, a["alert"]
        assert a["labels"]["severity"] in ("warning", "critical")


def test_the_tolerance_alert_repeats_no_tolerance() -> None:
    # it counts the calls the collector judged under the run's own policy: a rules file that names a tolerance
    # (the bf16 default, once) goes wrong for every run judged by another policy
    rule = next(a for a in _alerts() if a["alert"] == "ShadowdDiffAboveTolerance")
    recorded = {r["record"]: r["expr"] for g in _groups() for r in g["rules"] if "record" in r}
    expr = recorded[rule["expr"].split(">")[0].strip()]
    assert "shadowd_exceeded_calls_total" in expr and "histogram_quantile" not in expr
    assert str(DTYPE_DEFAULTS["bf16"]["rel_l2_max"]) not in rule["expr"] + expr
