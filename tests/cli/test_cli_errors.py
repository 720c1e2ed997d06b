"""The ``shadowd`` command's answers to bad input: one line naming what to fix, and exit status 64 (never one of
``shadowd readiness``' verdict codes 0-4), for the command line and for the configuration errors users make."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from shadowd.cli import EXIT_USAGE, main
from shadowd.readiness_cli import EXIT_NOT_READY, EXIT_REFUSED, EXIT_UNREACHABLE, readiness_command


def _err(capsys: pytest.CaptureFixture[str]) -> str:
    return capsys.readouterr().err


def test_a_bad_command_line_is_not_a_verdict(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["readiness", "--run", "abc"]) == EXIT_USAGE
    assert "Invalid value for '--run'" in _err(capsys)
    assert main(["readiness", "--no-such-flag"]) == EXIT_USAGE
    assert main(["no-such-command"]) == EXIT_USAGE
    # no command at all (a script's empty $CMD): the help, and a usage error rather than click's 2
    capsys.readouterr()
    for argv in ([], ["db"]):
        assert main(argv) == EXIT_USAGE, argv
        assert "Usage" in capsys.readouterr().out + _err(capsys), argv
    assert main(["demo", "--fault", "gremlins"]) == EXIT_USAGE
    assert "--fault must be one of" in _err(capsys)
    # a run id or a wait that cannot be one is a usage error, not "refused" (4) or a zero wait
    for argv, name in ((["--run", "0"], "--run"), (["--run", "-1"], "--run"), (["--wait", "-5"], "--wait"),
                       (["--wait", "nan"], "--wait"), (["--wait", "inf"], "--wait")):
        assert main(["readiness", "--url", "http://127.0.0.1:9", *argv]) == EXIT_USAGE, argv
        assert name in _err(capsys), argv


def test_database_url_and_file_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["db", "upgrade", "--db", "bogus://x"]) == EXIT_USAGE
    err = _err(capsys)
    assert "--db / SHADOWD_DB_URL" in err and "Traceback" not in err and len(err.splitlines()) == 1
    # another database SQLAlchemy knows (its driver not installed), or PostgreSQL through a driver the collector does
    # not run on: one line too — and for `db current` never its exit 1, which says "schema not current"
    for argv in (["db", "current"], ["db", "upgrade"], ["serve"]):
        for url in ("mysql://u@h/d", "postgresql+asyncpg://u@h/d"):
            assert main([*argv, "--db", url]) == EXIT_USAGE, (argv, url)
            err = _err(capsys)
            assert "db_url must be a sqlite:/// or postgresql+psycopg:// URL" in err and len(err.splitlines()) == 1
    missing_dir = tmp_path / "no" / "such" / "dir" / "x.db"
    assert main(["db", "upgrade", "--db", f"sqlite:///{missing_dir}"]) == EXIT_USAGE
    err = _err(capsys)
    assert "unable to open database file (does its directory exist?)" in err and len(err.splitlines()) == 1
    assert not missing_dir.parent.exists()
    db = f"sqlite:///{tmp_path / 'x.db'}"
    assert main(["db", "downgrade", "nosuchrev", "--db", db]) == EXIT_USAGE
    assert "migrations: " in _err(capsys)


def test_a_bad_policy_file_names_the_file_and_the_knob(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = f"sqlite:///{tmp_path / 'x.db'}"
    policy = tmp_path / "p.toml"
    policy.write_text("confidense = 0.9\n")
    assert main(["serve", "--db", db, "--upgrade", "--policy", str(policy)]) == EXIT_USAGE
    err = _err(capsys)
    assert f"policy file {policy}" in err and "confidense" in err and "Traceback" not in err
    policy.write_text("confidence = [\n")
    assert main(["serve", "--db", db, "--policy", str(policy)]) == EXIT_USAGE
    assert "not valid TOML" in _err(capsys)
    assert main(["serve", "--db", db, "--policy", str(tmp_path / "missing.toml")]) == EXIT_USAGE
    assert "no such file" in _err(capsys)
    # files that parse but hold no table of knobs, that are no text, or no file at all: one line too
    bad = {"list.json": b"[1, 2]", "null.json": b"null", "latin1.toml": "confidence = 0.9 # \xe9".encode("latin-1")}
    for name, content in bad.items():
        (tmp_path / name).write_bytes(content)
    (tmp_path / "dir.toml").mkdir()
    for name, says in (("list.json", "expected a table of knobs"), ("null.json", "expected a table of knobs"),
                       ("latin1.toml", "not UTF-8"), ("dir.toml", "a directory")):
        assert main(["serve", "--db", db, "--policy", str(tmp_path / name)]) == EXIT_USAGE, name
        err = _err(capsys)
        assert says in err and "Traceback" not in err and len(err.splitlines()) == 1, (name, err)
    upper = tmp_path / "P.TOML"  # (the suffix in capitals is TOML too)
    upper.write_text("confidence = [\n")
    assert main(["serve", "--db", db, "--policy", str(upper)]) == EXIT_USAGE
    assert "not valid TOML" in _err(capsys)
    # on a database not yet migrated the policy file is still what is named (not exit 3, "schema outdated")
    fresh = f"sqlite:///{tmp_path / 'fresh.db'}"
    assert main(["serve", "--db", fresh, "--policy", str(tmp_path / "missing.toml")]) == EXIT_USAGE
    assert "no such file" in _err(capsys)


def test_readiness_tells_a_refusal_from_a_foreign_404() -> None:
    def answer(status: int, **kw: object):  # one canned answer for every request
        return httpx.Client(base_url="http://x", transport=httpx.MockTransport(
            lambda request: httpx.Response(status, **kw)))  # type: ignore[arg-type]

    out: list[str] = []
    # the collector's own refusal (an unknown run): JSON with a detail
    assert readiness_command("http://x", 9, client=answer(404, json={"detail": "run 9 does not exist"}),
                             echo=out.append) == EXIT_REFUSED
    assert "run 9 does not exist" in out[-1]
    # another service at that URL: no verdict, not a refusal
    assert readiness_command("http://x", 9, client=answer(404, text="<!DOCTYPE HTML><title>404</title>"),
                             echo=out.append) == EXIT_UNREACHABLE
    assert "without a verdict" in out[-1] and "shadowd collector?" in out[-1]
    assert readiness_command("http://x", 9, client=answer(404), echo=out.append) == EXIT_UNREACHABLE
    assert "(empty body)" in out[-1]


def _verdict(verdict: str, criteria: list[dict] | None = None, fp: str = "fp-1") -> dict:
    return {"verdict": verdict, "run_id": 9, "run_key": "k", "candidate_fingerprint": fp,
            "reasons": [f"{verdict} because"], "criteria": criteria or []}


def test_readiness_wait_stops_on_a_not_ready_that_holds_and_shows_progress() -> None:
    # (--wait 86400 sat silent for a day on a NOT_READY the docs call permanent)
    calls: list[int] = []

    def client(bodies: list[dict]) -> httpx.Client:
        def handle(request: httpx.Request) -> httpx.Response:
            calls.append(1)
            body = bodies[min(len(calls), len(bodies)) - 1]
            return httpx.Response(200 if body["verdict"] == "READY" else 503, json=body)
        return httpx.Client(base_url="http://x", transport=httpx.MockTransport(handle))

    out: list[str] = []
    sticky = _verdict("NOT_READY", [{"name": "hard_failures", "status": "fail"}])
    assert readiness_command("http://x", 9, wait_s=60, poll_s=0.01, client=client([sticky]),
                             echo=out.append) == EXIT_NOT_READY
    assert len(calls) == 1, "no waiting on a verdict that holds for the run"
    # a NOT_READY that may pass (drift), then READY: waited for, with one progress line per change
    calls.clear()
    out.clear()
    drifting = _verdict("NOT_READY", [{"name": "drift", "status": "fail"}])
    bodies = [_verdict("INSUFFICIENT_DATA"), _verdict("INSUFFICIENT_DATA"), drifting, _verdict("READY")]
    assert readiness_command("http://x", 9, wait_s=60, poll_s=0.01, client=client(bodies), echo=out.append) == 0
    assert [line.split(":")[0] for line in out[:-1]] == ["waiting (60 s left)"] * 2 and out[-1].startswith("READY")


def test_readiness_for_an_expected_candidate_build() -> None:
    ready = _verdict("READY", fp="fp-old")
    client = httpx.Client(base_url="http://x", transport=httpx.MockTransport(
        lambda request: httpx.Response(200, json=ready)))
    out: list[str] = []
    assert readiness_command("http://x", 9, client=client, echo=out.append, expect_fingerprint="fp-new") == 1
    assert "not the expected fp-new" in out[-1]
    assert readiness_command("http://x", 9, client=client, echo=out.append, expect_fingerprint="fp-old") == 0


def test_readiness_json_is_one_document_with_the_exit_code_and_the_evidence() -> None:
    # (a pipeline that keeps the evidence of its gate parses standard output: progress lines go elsewhere)
    crit = [{"name": "exceedance", "status": "pass", "detail": "0/300 steps exceed"}]
    bodies = [_verdict("INSUFFICIENT_DATA"), _verdict("READY", crit, fp="fp-old")]
    calls: list[int] = []

    def handle(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        body = bodies[min(len(calls), len(bodies)) - 1]
        return httpx.Response(200 if body["verdict"] == "READY" else 503, json=body)

    client = httpx.Client(base_url="http://x", transport=httpx.MockTransport(handle))
    out: list[str] = []
    side: list[str] = []
    assert readiness_command("http://x", 9, wait_s=60, poll_s=0.01, client=client, echo=out.append,
                             as_json=True, progress=side.append) == 0
    assert len(out) == 1 and side and side[0].startswith("waiting (60 s left): INSUFFICIENT_DATA")
    doc = json.loads(out[0])
    assert doc["exit_code"] == 0 and doc["verdict"] == "READY" and doc["criteria"] == crit and doc["run_id"] == 9
    out.clear()
    assert readiness_command("http://x", 9, client=client, echo=out.append, as_json=True,
                             expect_fingerprint="fp-new") == EXIT_NOT_READY
    doc = json.loads(out[0])
    assert doc["exit_code"] == 1 and doc["verdict"] == "READY" and "not the expected fp-new" in doc["wrong_candidate"]
    out.clear()
    assert readiness_command("http://127.0.0.1:9", 9, echo=out.append, as_json=True) == EXIT_UNREACHABLE
    doc = json.loads(out[0])
    assert doc["exit_code"] == EXIT_UNREACHABLE and doc["error"].startswith("collector unreachable")


def test_readiness_json_through_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["readiness", "--url", "http://127.0.0.1:9", "--run", "3", "--json"]) == EXIT_UNREACHABLE
    doc = json.loads(capsys.readouterr().out)
    assert doc["exit_code"] == EXIT_UNREACHABLE and "unreachable" in doc["error"]


def test_version_flag_and_command(capsys: pytest.CaptureFixture[str]) -> None:
    from shadowd import __version__

    assert main(["--version"]) == 0 and capsys.readouterr().out.strip() == __version__
    assert main(["version"]) == 0 and capsys.readouterr().out.strip() == __version__


def test_db_current_names_the_revision_and_creates_no_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "x.db"
    assert main(["db", "current", "--db", f"sqlite:///{path}"]) == 1
    assert f"no database file at {path}" in capsys.readouterr().out and not path.exists()
    assert main(["db", "upgrade", "--db", f"sqlite:///{path}"]) == 0
    capsys.readouterr()
    assert main(["db", "current", "--db", f"sqlite:///{path}"]) == 0
    assert "database schema is current (revision " in capsys.readouterr().out


@pytest.fixture()
def busy_port() -> Iterator[int]:
    """A port something else listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


def test_serve_on_a_port_in_use_names_the_port(tmp_path: Path, busy_port: int,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    # (it started the app, migrated the database and only then failed in uvicorn, exit 3: the code for an
    # outdated schema)
    db = tmp_path / "x.db"
    assert main(["serve", "--db", f"sqlite:///{db}", "--upgrade", "--port", str(busy_port)]) == EXIT_USAGE
    err = _err(capsys)
    assert f"127.0.0.1:{busy_port}" in err and "--port / SHADOWD_PORT" in err and len(err.splitlines()) == 1
    assert not db.exists()  # refused before anything was started


def test_serve_with_an_unknown_log_level_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--db", f"sqlite:///{tmp_path / 'x.db'}", "--log-level", "loud"]) == EXIT_USAGE
    err = _err(capsys)
    assert "Invalid value for '--log-level'" in err and "Traceback" not in err


@pytest.mark.parametrize("url", ["http://[::1", "127.0.0.1:8787", "ftp://x", "http://"])
def test_readiness_with_a_malformed_url_is_a_usage_error(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    # (exit 3, "collector unreachable", or a traceback and exit 1: NOT_READY to a pipeline)
    assert main(["readiness", "--url", url]) == EXIT_USAGE
    err = _err(capsys)
    assert "Invalid value for '--url'" in err and "Traceback" not in err


def test_demo_on_a_port_in_use_is_refused_before_any_traffic(busy_port: int,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    # (it drove its whole workload into whatever collector answered there, judged with that one's policy)
    pytest.importorskip("torch")
    assert main(["demo", "--port", str(busy_port), "--duration", "1"]) == EXIT_USAGE
    captured = capsys.readouterr()
    assert f"--port {busy_port}" in captured.err and len(captured.err.splitlines()) == 1
    assert "steps" not in captured.out
    assert main(["demo", "--port", "70000"]) == EXIT_USAGE


def test_demo_with_a_database_url_it_cannot_use_names_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # (the collector refused the URL with exit 64 and one line in its log; the demo said "did not start", exit 1)
    pytest.importorskip("torch")
    for url, says in (("bogus://x", "db_url must be"),
                      (f"sqlite:///{tmp_path / 'no' / 'dir' / 'x.db'}", "does its directory exist?")):
        assert main(["demo", "--db", url, "--duration", "1"]) == EXIT_USAGE
        err = capsys.readouterr().err
        assert "--db / SHADOWD_DB_URL" in err and says in err and len(err.splitlines()) == 1, err
