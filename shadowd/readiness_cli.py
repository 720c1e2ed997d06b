"""``shadowd readiness``: print a run's verdict and reasons; the exit status is a pipeline gate.

Exit codes:

- 0  READY
- 1  NOT_READY
- 2  INSUFFICIENT_DATA
- 3  the collector is unreachable (connection refused, timeout, or an HTTP answer without a verdict: also a 404
     that is not the collector's own, e.g. from another service at that URL)
- 4  the request was refused by the collector (unknown run, missing or wrong token)
- 64 a bad command line (``shadowd.cli.EXIT_USAGE``, through the ``shadowd`` command)

``--wait SECONDS`` polls until READY or until the time is up, and exits with the last answer's code; it stops at
once on a NOT_READY that holds for the run (a hard failure, a producer that gave up on its candidate: ``STICKY``),
and prints a line whenever the verdict or its first reason changes while it waits.

``--expect-fingerprint FP``: the gate is for that candidate build. A run whose candidate fingerprint differs is
NOT_READY for it (exit 1, saying both), whatever its verdict.

``--json`` prints the last answer as one JSON document instead (the collector's readiness body — verdict,
criteria with their figures, producer notes — plus ``exit_code``), for a pipeline that keeps the evidence of its
gate; the exit codes are the same, and a wait's progress lines go to standard error.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any

import httpx

__all__ = [
    "EXIT_CODES",
    "EXIT_INSUFFICIENT_DATA",
    "EXIT_NOT_READY",
    "EXIT_READY",
    "EXIT_REFUSED",
    "EXIT_UNREACHABLE",
    "answer_error",
    "evidence_lines",
    "fetch_readiness",
    "format_report",
    "json_report",
    "readiness_command",
    "shapes_line",
    "timing_line",
]

EXIT_READY = 0
EXIT_NOT_READY = 1
EXIT_INSUFFICIENT_DATA = 2
EXIT_UNREACHABLE = 3
EXIT_REFUSED = 4
EXIT_CODES = {"READY": EXIT_READY, "NOT_READY": EXIT_NOT_READY, "INSUFFICIENT_DATA": EXIT_INSUFFICIENT_DATA}
#: criteria whose failure holds for the rest of the run: waiting cannot turn it READY
STICKY = ("hard_failures", "producers")


def _sticky(body: dict[str, Any]) -> bool:
    return any(c.get("name") in STICKY and c.get("status") == "fail" for c in body.get("criteria") or [])


def _wrong_candidate(body: dict[str, Any], expect: str | None) -> str | None:
    got = body.get("candidate_fingerprint")
    if expect is None or "verdict" not in body or got == expect:
        return None
    return f"the run's candidate is {got}, not the expected {expect}: its verdict is not for that build"


def fetch_readiness(client: httpx.Client, run_id: int | None) -> tuple[int, dict[str, Any]]:
    """One ``GET /readiness``: (exit code, body or an error description)."""
    params = {"run_id": run_id} if run_id is not None else None
    try:
        resp = client.get("/readiness", params=params)
    except httpx.HTTPError as exc:
        return EXIT_UNREACHABLE, {"error": f"collector unreachable: {exc.__class__.__name__}: {exc}"}
    try:
        body = resp.json()
    except ValueError:
        body = None
    if resp.status_code in (200, 503) and isinstance(body, dict) and body.get("verdict") in EXIT_CODES:
        return EXIT_CODES[body["verdict"]], body
    code, message = answer_error(resp, body, "a verdict")
    return code, {"error": message}


def answer_error(resp: httpx.Response, body: Any, wanted: str) -> tuple[int, str]:
    """(exit code, line) for an answer that is not the ``wanted`` one (``a verdict``, ``a run``), for every command
    that asks the collector: its own refusal (JSON with a ``detail``: unknown run, token) is EXIT_REFUSED; its own
    5xx (its database away) and any answer that is not the collector's (a proxy, another service at that URL, the
    same status without a ``detail``) are EXIT_UNREACHABLE, worth trying again."""
    detail = body.get("detail") if isinstance(body, dict) else None
    if resp.status_code in (401, 403, 404, 422) and detail is not None:
        return EXIT_REFUSED, f"HTTP {resp.status_code}: {detail}"
    if resp.status_code >= 500 and detail is not None:
        return EXIT_UNREACHABLE, f"collector unavailable: HTTP {resp.status_code}: {detail}"
    text = resp.text[:300].strip() or "(empty body)"
    return EXIT_UNREACHABLE, f"HTTP {resp.status_code} without {wanted} (is {resp.url} a shadowd collector?): {text}"


def evidence_lines(body: dict[str, Any]) -> list[str]:
    """What a READY verdict rests on: one line per criterion the judge applied, ``  ok <name>: <detail>``
    (informational ones marked ``info``). Empty for any other verdict: its reasons say what stands in the way."""
    if body.get("verdict") != "READY":
        return []
    lines = []
    for c in body.get("criteria") or []:
        if isinstance(c, dict) and c.get("name"):
            mark = "info" if c.get("informational") else "ok"
            lines.append(f"  {mark} {c['name']}: {c.get('detail', '')}")
    return lines


def timing_line(body: dict[str, Any]) -> str | None:
    """The measured speed-up of a readiness answer (its ``timing``) as one line, with the shape bucket where it is
    lowest when there are several; None before any call was timed (or from a collector that reports none)."""
    t = body.get("timing")
    if not isinstance(t, dict) or not t.get("timed_calls") or t.get("speedup") is None:
        return None
    line = (f"  speed-up {t['speedup']:.2f}x over {t['timed_calls']} timed calls: "
            f"candidate {t['candidate_us']:.1f} µs, baseline {t['baseline_us']:.1f} µs per call")
    low = t.get("lowest_bucket")
    if isinstance(low, dict):
        line += f"; lowest {low['speedup']:.2f}x in {low['bucket']} ({low['timed_calls']} calls)"
    return line


def shapes_line(body: dict[str, Any]) -> str | None:
    """For a READY answer, the shapes it speaks for (its ``covered_shapes``) as one line: what on mode behind a
    promotion gate serves the candidate on; None otherwise (or from a collector that does not say)."""
    rows = body.get("covered_shapes")
    if body.get("verdict") != "READY" or not isinstance(rows, list) or not rows:
        return None
    try:
        bs, t, p = (max(int(r[i]) for r in rows) for i in range(3))
    except (TypeError, ValueError, IndexError):
        return None
    return (f"  shapes: {len(rows)} shape buckets (batches up to {bs}, trees up to {t} nodes, prefixes below "
            f"{1 << p} tokens): on mode behind a promotion gate serves the candidate on these only")


def format_report(body: dict[str, Any]) -> str:
    """The verdict line, then one line per reason (or, for READY, per criterion passed: :func:`evidence_lines`, and
    the shapes it covers: :func:`shapes_line`), the measured speed-up (:func:`timing_line`), and why a rank's
    candidate was disabled or fell back."""
    if "verdict" not in body:
        return f"ERROR {body.get('error', body)}"
    head = f"{body['verdict']}  run {body.get('run_id')} ({body.get('run_key', '')})"
    fp = body.get("candidate_fingerprint")
    if fp:
        head += f"  candidate {fp}"
    lines = [head]
    lines += [f"  - {r}" for r in body.get("reasons", [])]
    lines += evidence_lines(body)
    shapes = shapes_line(body)
    if shapes is not None:
        lines.append(shapes)
    speed = timing_line(body)
    if speed is not None:
        lines.append(speed)
    for n in body.get("producer_notes") or []:
        for what, key in (("candidate disabled", "disabled_reason"), ("fell back", "fallback_reason")):
            if n.get(key):
                stage = f"stage {n['stage']} " if n.get("stage") else ""  # (a pipeline's stages share TP ranks)
                lines.append(f"  {stage}rank {n.get('rank')}: {what}: {n[key]}")
    return "\n".join(lines)


def json_report(body: dict[str, Any], code: int, wrong_candidate: str | None = None) -> str:
    """The ``--json`` form of an answer: the collector's readiness body (criteria, figures, producer notes) with
    the gate's ``exit_code``, and ``wrong_candidate`` when ``--expect-fingerprint`` refused it; an unreachable or
    refusing collector gives ``{"exit_code": ..., "error": ...}``."""
    out = {"exit_code": code, **body}
    if wrong_candidate is not None:
        out["wrong_candidate"] = wrong_candidate
    return json.dumps(out, indent=2, sort_keys=True)


def readiness_command(url: str, run_id: int | None = None, wait_s: float = 0.0, token: str | None = None, *,
                      poll_s: float = 5.0, client: httpx.Client | None = None,
                      echo: Callable[[str], None] = print, expect_fingerprint: str | None = None,
                      as_json: bool = False, progress: Callable[[str], None] | None = None) -> int:
    """Print the verdict of ``run_id`` (latest run when None) at ``url``; return the exit code.

    With ``wait_s`` > 0, poll every ``poll_s`` seconds until READY, a NOT_READY that holds for the run, or
    ``wait_s`` has passed. ``expect_fingerprint``: see the module docstring. ``client`` replaces the HTTP client
    (tests pass a TestClient). ``as_json``: the last answer goes out as :func:`json_report`, one JSON document,
    and the progress lines of a wait go to ``progress`` (default: standard error), so that standard output parses.
    """
    if progress is None:
        progress = echo if not as_json else (lambda line: print(line, file=sys.stderr))
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    own = client is None
    http = client if client is not None else httpx.Client(base_url=url.rstrip("/"), timeout=10.0)
    if headers:
        http.headers.update(headers)
    deadline = time.monotonic() + max(0.0, wait_s)
    last: tuple[Any, ...] | None = None
    try:
        while True:
            code, body = fetch_readiness(http, run_id)
            wrong = _wrong_candidate(body, expect_fingerprint)
            if wrong is not None:
                if as_json:
                    echo(json_report(body, EXIT_NOT_READY, wrong))
                else:
                    echo(format_report(body))
                    echo(f"NOT_READY for the expected candidate: {wrong}")
                return EXIT_NOT_READY
            remaining = deadline - time.monotonic()
            if (code in (EXIT_READY, EXIT_REFUSED) or remaining <= 0
                    or (code == EXIT_NOT_READY and _sticky(body))):
                echo(json_report(body, code) if as_json else format_report(body))
                return code
            now = (body.get("verdict"), (body.get("reasons") or [body.get("error")])[0])
            if now != last:  # progress while waiting: what stands in the way, when it changes
                progress(f"waiting ({remaining:.0f} s left): {now[0] or 'no verdict'}: {now[1]}")
                last = now
            time.sleep(min(poll_s, remaining))
    finally:
        if own:
            http.close()
