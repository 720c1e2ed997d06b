"""Fixtures of the observability tests: external tools (required in CI, skipped with a reason
elsewhere), a real collector on a loopback port fed with a seeded run, Prometheus and Alertmanager
started with the repository's own config files."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client import CollectorRegistry

from tests.observability.seed import feed, seed_run

REPO = Path(__file__).resolve().parents[2]
DASHBOARDS = REPO / "dashboards"
PROM_DIR = DASHBOARDS / "prometheus"
ARTIFACTS = REPO / "test-artifacts"
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require_tool(*names: str) -> str:
    """Path of the first of ``names`` on PATH; a missing tool fails in CI and skips (visibly) elsewhere."""
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    why = f"{' / '.join(names)} not installed (run .ci/install-observability.sh)"
    if IN_CI:
        pytest.fail(f"CI must run this test: {why}")
    pytest.skip(why)


def build_app(db_url: str) -> Any:
    """A collector app on its own registry; the periodic evaluator is held off (tests store evaluations)."""
    from shadowd.collector.app import create_app
    from shadowd.collector.settings import CollectorSettings

    settings = CollectorSettings(db_url=db_url, auto_upgrade=True, eval_interval_s=3600)
    return create_app(settings, registry=CollectorRegistry())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, timeout: float = 20.0, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout
    last: Exception | str = "no answer"
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
        try:
            r = httpx.get(url, timeout=2)
            if r.status_code == 200:
                return
            last = f"HTTP {r.status_code}"
        except httpx.HTTPError as exc:
            last = exc
        time.sleep(0.1)
    raise TimeoutError(f"{url} not ready after {timeout}s: {last}")


@dataclass
class Collector:
    url: str
    port: int
    app: Any
    run_id: int
    client: httpx.Client


@pytest.fixture(scope="session")
def collector(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Collector]:
    """A real collector (uvicorn in a thread, loopback): a seeded run, live traffic in the background."""
    import uvicorn

    db = tmp_path_factory.mktemp("collector") / "shadowd.db"
    app = build_app(f"sqlite:///{db}")
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    thread = threading.Thread(target=server.run, name="collector", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/healthz")
    client = httpx.Client(base_url=url, timeout=30)
    run_id = seed_run(client)
    app.state.evaluator.evaluate(run_id)  # the real judge: NOT_READY (a non-finite mismatch)

    stop = threading.Event()

    def traffic() -> None:  # live batches, so rates over short windows are non-zero
        seq = 0
        while not stop.wait(0.4):
            feed(client, run_id, seq)
            seq += 1

    feeder = threading.Thread(target=traffic, name="feeder", daemon=True)
    feeder.start()
    try:
        yield Collector(url=url, port=port, app=app, run_id=run_id, client=client)
    finally:
        stop.set()
        feeder.join(5)
        client.close()
        server.should_exit = True
        thread.join(10)


def _start(cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=log.parent)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


@pytest.fixture(scope="session")
def alertmanager(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Alertmanager with dashboards/prometheus/alertmanager.yml, on loopback, no clustering."""
    binary = require_tool("prometheus-alertmanager", "alertmanager")
    work = tmp_path_factory.mktemp("alertmanager")
    port = free_port()
    proc = _start(
        [
            binary,
            f"--config.file={PROM_DIR / 'alertmanager.yml'}",
            f"--storage.path={work / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--cluster.listen-address=",
        ],
        work / "log.txt",
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/-/ready", proc=proc)
        yield url
    finally:
        _stop(proc)


@pytest.fixture(scope="session")
def prometheus(
    collector: Collector, alertmanager: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """Prometheus with the repository's prometheus.yml and rules.yml; targets and intervals for loopback."""
    binary = require_tool("prometheus")
    work = tmp_path_factory.mktemp("prometheus")
    config = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = [str(PROM_DIR / f) for f in config["rule_files"]]
    config["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] = [alertmanager.split("//")[1]]
    job = next(j for j in config["scrape_configs"] if j["job_name"] == "shadowd")
    job["static_configs"][0]["targets"] = [f"127.0.0.1:{collector.port}"]
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    proc = _start(
        [
            binary,
            f"--config.file={work / 'prometheus.yml'}",
            f"--storage.tsdb.path={work / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        work / "log.txt",
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/-/ready", proc=proc)
        # enough scrapes for rates over the short windows the queries use
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            r = httpx.get(
                f"{url}/api/v1/query", params={"query": 'count_over_time(up{job="shadowd"}[1m])'}
            ).json()
            if r["data"]["result"] and float(r["data"]["result"][0]["value"][1]) >= 5:
                break
            time.sleep(0.5)
        yield url
    finally:
        _stop(proc)
