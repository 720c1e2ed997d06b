"""The ``shadowd`` command's answers to bad input: one line naming what to fix, and exit status 64 (never one of
``shadowd readiness``' verdict codes 0-4), for the command line and for the configuration errors users make."""

from __future__ import annotations

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
    assert main(["demo", "--fault", "gremlins"]) == EXIT_USAGE
    assert "--fault must be one of" in _err(capsys)


def test_database_url_and_file_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["db", "upgrade", "--db", "bogus://x"]) == EXIT_USAGE
    err = _err(capsys)
    assert "--db / SHADOWD_DB_URL" in err and "Traceback" not in err and len(err.splitlines()) == 1
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
