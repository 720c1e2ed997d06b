"""The built-in status page (GET /): content through the app, and rendered in headless Chromium."""

from __future__ import annotations

import re
import struct
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.factories import make_batch, run_body
from tests.observability.conftest import ARTIFACTS, Collector, build_app, require_tool
from tests.observability.seed import EVALUATION_REPORT, seed_run, store_evaluation


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    app = build_app(f"sqlite:///{tmp_path / 's.db'}")
    with TestClient(app) as c:
        yield c


def _assert_self_contained(page: str) -> None:
    assert "<script" not in page.lower()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page), "external asset"
    assert "@import" not in page and "url(" not in page


def test_no_runs(client: TestClient) -> None:
    r = client.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "No runs yet" in r.text
    _assert_self_contained(r.text)


def test_run_without_evaluation(client: TestClient) -> None:
    run_id = client.post("/v1/runs", json=run_body("plain", num_layers=4)).json()["id"]
    assert client.post(f"/v1/runs/{run_id}/samples", json=make_batch(400, ts0=1.7e9)).status_code == 200
    page = client.get(f"/?run_id={run_id}").text
    assert "no evaluation yet" in page
    assert "accept length by mode</dt><dd>not reported" in page
    assert "on-mode calls</dt><dd>no on-mode call" in page
    assert "speed-up</dt><dd>no timed calls yet" in page
    assert 'id="heatmap"' in page and 'id="exceedance"' in page
    assert page.count("<rect") >= 4  # one cell per layer at least
    _assert_self_contained(page)


def test_the_run_section_shows_the_measured_speed_up(client: TestClient) -> None:
    run_id = client.post("/v1/runs", json=run_body("timed", num_layers=2)).json()["id"]
    timed = [make_batch(300, num_layers=2, seq=0, shapes=[(1, 16, 32768, 8)], cand_us=50.0, base_us=5000.0),
             make_batch(100, num_layers=2, seq=1, step0=150, shapes=[(16, 8, 8192, 8)], cand_us=100.0, base_us=1300.0)]
    for b in timed:
        assert client.post(f"/v1/runs/{run_id}/samples", json=b).status_code == 200
    page = client.get(f"/?run_id={run_id}").text
    speed = (300 * 5000 + 100 * 1300) / (300 * 50 + 100 * 100)
    assert (f"speed-up</dt><dd>{speed:.2f}× · 62.5 / 4075.0 µs per call (candidate / baseline) · 400 timed calls · "
            "lowest 13.00× in bs16-t8-p") in page
    _assert_self_contained(page)


def test_the_run_section_shows_how_much_on_mode_traffic_the_verdict_covers(client: TestClient) -> None:
    run_id = client.post("/v1/runs", json=run_body("on", num_layers=2, tp_size=2)).json()["id"]
    for rank, cov, unc in ((0, 3000, 200), (1, 2800, 0)):
        b = {**make_batch(20, num_layers=2, rank=rank, producer=f"r{rank}"),
             "producer_stats": {"on_covered_calls": cov, "on_uncovered_calls": unc}}
        assert client.post(f"/v1/runs/{run_id}/samples", json=b).status_code == 200
    page = client.get(f"/?run_id={run_id}").text
    assert "on-mode calls</dt><dd>5,800 on covered shapes · 200 outside them (baseline served, 3.3%)" in page
    _assert_self_contained(page)


def test_latest_evaluation_with_reasons_and_criteria(client: TestClient) -> None:
    run_id = seed_run(client, minutes=4)
    store_evaluation(
        client.app, run_id, {"verdict": "INSUFFICIENT_DATA", "reasons": ["older"], "criteria": []}
    )
    store_evaluation(client.app, run_id)
    page = client.get("/").text  # latest run by default
    assert "v-NOT_READY" in page and "older" not in page
    for reason in EVALUATION_REPORT["reasons"]:
        assert reason in page
    assert page.count(">FAIL<") == 2 and page.count(">pass<") == 2
    assert "non-finite or error" in page  # the heatmap marks the layer with a non-finite mismatch
    assert re.search(r"accept length by mode</dt><dd>validate \d", page), "SGLang's accept length, per mode"
    _assert_self_contained(page)


def test_report_of_the_real_judge(client: TestClient) -> None:
    run_id = seed_run(client, minutes=6)
    report = client.app.state.evaluator.evaluate(run_id)
    page = client.get(f"/?run_id={run_id}").text
    assert report["verdict"] == "NOT_READY" and "v-NOT_READY" in page
    for c in report["criteria"]:
        assert f"<td>{c['name']}</td>" in page
    assert ">FAIL<" in page and ">need data<" in page and ">pass<" in page
    assert page.index("hard_failures") < page.index("requests</td>")  # failures listed first
    _assert_self_contained(page)


def test_unknown_run_and_bad_id(client: TestClient) -> None:
    assert client.get("/?run_id=4242").status_code == 404
    assert client.get("/?run_id=abc").status_code == 422


def test_run_key_is_escaped(client: TestClient) -> None:
    client.post("/v1/runs", json=run_body("<script>alert(1)</script>", num_layers=2))
    page = client.get("/").text
    assert "<script>" not in page and "&lt;script&gt;" in page


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])


def _chromium(binary: str, tmp: Path, *args: str) -> Any:
    cmd = [
        binary,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp / 'chromium-profile'}",
        "--window-size=1280,1600",
        *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=90)


def test_status_page_in_headless_chromium(collector: Collector, tmp_path: Path) -> None:
    binary = require_tool("chromium", "chromium-browser")
    url = f"{collector.url}/?run_id={collector.run_id}"
    dom = _chromium(binary, tmp_path, "--dump-dom", url)
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    assert "NOT_READY" in html and "Criteria" in html and "hard_failures" in html
    heatmap = re.search(r'<svg id="heatmap".*?</svg>', html, re.S)
    assert heatmap and heatmap.group(0).count("<rect") > 6 * 10, "heatmap missing or empty"
    assert '<svg id="exceedance"' in html
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "status-page.png"
    shot.unlink(missing_ok=True)
    r = _chromium(binary, tmp_path, f"--screenshot={shot}", url)
    assert r.returncode == 0 and shot.is_file(), r.stderr[-2000:]
    assert _png_size(shot) == (1280, 1600)
    assert shot.stat().st_size > 20_000, "screenshot looks blank"
