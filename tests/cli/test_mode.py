"""``shadowd mode``: the kill switch from the command line — what it prints, what it stores, its exit codes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from shadowd.cli import EXIT_USAGE, main
from shadowd.collector.app import create_app
from shadowd.collector.settings import CollectorSettings
from shadowd.mode_cli import EXIT_OK, mode_command
from shadowd.readiness_cli import EXIT_REFUSED, EXIT_UNREACHABLE
from tests.factories import run_body


@pytest.fixture
def app_client(tmp_path: Path) -> Iterator[TestClient]:
    settings = CollectorSettings(db_url=f"sqlite:///{tmp_path}/shadowd.db", auto_upgrade=True, token="s3cret",
                                 eval_interval_s=3600.0)
    app = create_app(settings, CollectorRegistry())
    with TestClient(app) as c:
        c.headers.update({"Authorization": "Bearer s3cret"})
        yield c
    app.state.shadowd.engine.dispose()


def _register(c: TestClient, key: str) -> int:
    r = c.post("/v1/runs", json=run_body(key, num_layers=2))
    assert r.status_code == 201, r.text
    return int(r.json()["id"])


def _override(c: TestClient, run_id: int) -> str | None:
    value: str | None = c.get(f"/v1/runs/{run_id}").json()["mode_override"]
    return value


def test_set_show_and_clear_the_kill_switch(app_client: TestClient) -> None:
    rid = _register(app_client, "on-run")
    out: list[str] = []
    assert mode_command("http://testserver", rid, client=app_client, echo=out.append) == EXIT_OK
    assert out == [f"run {rid} (on-run): kill switch none"]

    out.clear()
    assert mode_command("http://testserver", rid, "validate", client=app_client, echo=out.append) == EXIT_OK
    assert _override(app_client, rid) == "validate"
    assert out[0].startswith(f"run {rid} (on-run): kill switch validate (was none): every rank serves SGLang's")

    out.clear()
    assert mode_command("http://testserver", rid, "off", client=app_client, echo=out.append) == EXIT_OK
    assert _override(app_client, rid) == "off"
    assert "kill switch off (was validate)" in out[0]

    out.clear()
    assert mode_command("http://testserver", rid, "clear", client=app_client, echo=out.append) == EXIT_OK
    assert _override(app_client, rid) is None
    assert "kill switch none (was off): every rank is back in its own configured mode" in out[0]


def test_an_unknown_run_or_a_bad_token_is_refused_and_changes_nothing(app_client: TestClient) -> None:
    rid = _register(app_client, "kept")
    out: list[str] = []
    assert mode_command("http://testserver", rid + 100, "off", client=app_client, echo=out.append) == EXIT_REFUSED
    assert out[0].startswith("ERROR HTTP 404") and str(rid + 100) in out[0]
    assert _override(app_client, rid) is None

    out.clear()
    assert mode_command("http://testserver", rid, "off", "wrong", client=app_client, echo=out.append) == EXIT_REFUSED
    assert out[0].startswith("ERROR HTTP 403") and "authorization" in out[0]
    app_client.headers.update({"Authorization": "Bearer s3cret"})
    assert _override(app_client, rid) is None


def test_an_unreachable_collector_or_another_service_is_exit_3() -> None:
    out: list[str] = []
    assert mode_command("http://127.0.0.1:9", 1, "off", echo=out.append) == EXIT_UNREACHABLE
    assert out[0].startswith("ERROR collector unreachable: ConnectError")

    # a 404 page of some other web server at that URL is no refusal by a collector
    html = httpx.MockTransport(lambda req: httpx.Response(404, text="<html>not found</html>"))
    out.clear()
    with httpx.Client(base_url="http://elsewhere", transport=html) as other:
        assert mode_command("http://elsewhere", 1, "off", client=other, echo=out.append) == EXIT_UNREACHABLE
    assert "without a run (is http://elsewhere/v1/runs/1 a shadowd collector?)" in out[0]

    # the collector's own 503 (its database away) says so, and is retryable (3), not a refusal
    def db_down(req: httpx.Request) -> httpx.Response:
        if req.method == "GET":
            return httpx.Response(200, json={"id": 1, "run_key": "k", "mode_override": None})
        return httpx.Response(503, json={"detail": {"field": "database", "error": "unavailable"}},
                              headers={"Retry-After": "5"})

    out.clear()
    with httpx.Client(base_url="http://c", transport=httpx.MockTransport(db_down)) as down:
        assert mode_command("http://c", 1, "off", client=down, echo=out.append) == EXIT_UNREACHABLE
    assert out[0].startswith("ERROR collector unavailable: HTTP 503") and "database" in out[0]


def test_a_mode_the_kill_switch_cannot_set_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["mode", "3", "on", "--url", "http://127.0.0.1:9"]) == EXIT_USAGE
    assert "the kill switch only lowers a mode" in capsys.readouterr().err
    assert main(["mode", "3", "paused", "--url", "http://127.0.0.1:9"]) == EXIT_USAGE
    assert "'paused' is not one of validate, off, clear" in capsys.readouterr().err
    assert main(["mode", "0", "off", "--url", "http://127.0.0.1:9"]) == EXIT_USAGE
    assert main(["mode", "3", "off", "--url", "ftp://x"]) == EXIT_USAGE
    with pytest.raises(ValueError, match="mode must be one of"):
        mode_command("http://127.0.0.1:9", 3, "on")
