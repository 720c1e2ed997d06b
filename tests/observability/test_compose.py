"""docker-compose.yml and the collector's Dockerfile, validated offline.

There is no Docker engine on the test machines."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import yaml

from tests.observability.conftest import REPO, require_tool

COMPOSE = REPO / "docker-compose.yml"


def _compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def test_compose_file_matches_the_compose_spec() -> None:
    if importlib.util.find_spec("check_jsonschema") is not None:
        cmd = [sys.executable, "-m", "check_jsonschema"]
    else:
        cmd = [require_tool("check-jsonschema")]
    p = subprocess.run(
        [*cmd, "--builtin-schema", "vendor.compose-spec", str(COMPOSE)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stdout + p.stderr


def test_stack_services_health_checks_and_volumes() -> None:
    doc = _compose()
    services = doc["services"]
    assert {"collector", "postgres", "prometheus", "alertmanager", "grafana"} <= set(services)
    for name, svc in services.items():
        assert "healthcheck" in svc, f"{name} has no health check"
        for port in svc.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"
    probe = " ".join(services["collector"]["healthcheck"]["test"])
    assert "/healthz" in probe and "/readiness" not in probe
    assert services["collector"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert "postgresql+psycopg://" in services["collector"]["environment"]["SHADOWD_DB_URL"]
    for name in ("postgres", "prometheus", "alertmanager", "grafana"):
        named = [v.split(":")[0] for v in services[name]["volumes"] if not v.startswith("./")]
        assert named and set(named) <= set(doc["volumes"]), f"{name} keeps no data volume"


def test_bind_mounts_exist_and_prometheus_reads_the_tested_files() -> None:
    services = _compose()["services"]
    for name, svc in services.items():
        for v in svc.get("volumes", []):
            if v.startswith("./"):
                assert (REPO / v.split(":")[0]).exists(), f"{name}: {v} does not exist"
    mounts = {
        v.split(":")[1]: v.split(":")[0] for v in services["prometheus"]["volumes"] if v.startswith("./")
    }
    assert mounts["/etc/prometheus/prometheus.yml"] == "./dashboards/prometheus/prometheus.yml"
    assert mounts["/etc/prometheus/rules.yml"] == "./dashboards/prometheus/rules.yml"
    am = {v.split(":")[1]: v.split(":")[0] for v in services["alertmanager"]["volumes"] if v.startswith("./")}
    assert am["/etc/alertmanager/alertmanager.yml"] == "./dashboards/prometheus/alertmanager.yml"
    prom = yaml.safe_load((REPO / "dashboards/prometheus/prometheus.yml").read_text())
    assert prom["scrape_configs"][0]["static_configs"][0]["targets"] == ["collector:8787"]
    assert prom["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] == ["alertmanager:9093"]


def test_dockerfile_installs_postgres_extra_without_torch() -> None:
    text = (REPO / "Dockerfile").read_text()
    installs = [line for line in text.splitlines() if "pip install" in line]
    assert installs and all('".[postgres]"' in line for line in installs)
    assert not any("torch" in line or "sglang" in line for line in installs)
    probe = next(line for line in text.splitlines() if line.strip().startswith("CMD python"))
    assert "/healthz" in probe
    for line in text.splitlines():
        if line.startswith("COPY "):
            for src in line.split()[1:-1]:
                assert (REPO / src).exists(), f"COPY {src}: missing"
