"""``shadowd mode``: read or set a run's kill switch at the collector, the rollback step of the runbook.

``shadowd mode RUN`` prints the run's override; ``shadowd mode RUN validate`` (or ``off``) lowers every producer
of the run to that mode — each rank picks it up from its next exchange with the collector (within the streamer's
poll interval, 2 s by default) and acts on it from its next call, CUDA-graph replays included; ``shadowd mode RUN
clear`` lifts the override (each rank returns to its own ``SHADOWD_MODE``). The override only lowers a mode
(on → validate → off): there is no way to force ``on`` from the collector.

Exit codes (shared with ``shadowd readiness`` where they mean the same):

- 0  done (or, without a mode, the override printed)
- 3  the collector is unreachable (connection refused, timeout, or an answer that is not the collector's)
- 4  the request was refused by the collector (unknown run, missing or wrong token)
- 64 a bad command line (``shadowd.cli.EXIT_USAGE``, through the ``shadowd`` command)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx

from shadowd.readiness_cli import EXIT_UNREACHABLE, answer_error

__all__ = ["CHOICES", "EXIT_OK", "describe", "mode_command"]

EXIT_OK = 0
#: what the command line takes, and what it sends (``clear`` lifts the override: JSON null)
CHOICES: dict[str, str | None] = {"validate": "validate", "off": "off", "clear": None}

_EFFECT = {
    "validate": "every rank serves SGLang's kernel again and keeps comparing the candidate",
    "off": "every rank serves SGLang's kernel only (no candidate calls)",
    None: "every rank is back in its own configured mode (SHADOWD_MODE)",
}


class _Failed(Exception):
    """A request that did not do its job: the exit code and the line that says why."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def _call(http: httpx.Client, method: str, path: str, **kw: Any) -> dict[str, Any]:
    """One request that must answer 200 with a run: its body, else :class:`_Failed` (refused or unreachable)."""
    try:
        resp = http.request(method, path, **kw)
    except httpx.HTTPError as exc:
        raise _Failed(EXIT_UNREACHABLE, f"collector unreachable: {type(exc).__name__}: {exc}") from None
    try:
        body = resp.json()
    except ValueError:
        body = None
    if resp.status_code == 200 and isinstance(body, dict) and "id" in body:
        return body
    raise _Failed(*answer_error(resp, body, "a run"))


def describe(run: dict[str, Any]) -> str:
    """``run 12 (key): kill switch validate`` (``none`` when no override is set)."""
    return f"run {run.get('id')} ({run.get('run_key', '')}): kill switch {run.get('mode_override') or 'none'}"


def mode_command(url: str, run_id: int, mode: str | None = None, token: str | None = None, *,
                 client: httpx.Client | None = None, echo: Callable[[str], None] = print) -> int:
    """Print run ``run_id``'s kill switch at ``url``; with ``mode`` (a key of :data:`CHOICES`) set it first.
    Returns the exit code. ``client`` replaces the HTTP client (tests pass a TestClient)."""
    if mode is not None and mode not in CHOICES:
        raise ValueError(f"mode must be one of {', '.join(CHOICES)}, got {mode!r}")
    own = client is None
    http = client if client is not None else httpx.Client(base_url=url.rstrip("/"), timeout=10.0)
    if token:
        http.headers.update({"Authorization": f"Bearer {token}"})
    try:
        before = _call(http, "GET", f"/v1/runs/{run_id}")
        if mode is None:
            echo(describe(before))
            return EXIT_OK
        want = CHOICES[mode]
        after = _call(http, "PUT", f"/v1/runs/{run_id}/mode", json={"mode": want})
        was = before.get("mode_override") or "none"
        echo(f"{describe(after)} (was {was}): {_EFFECT[want]}, from each rank's next exchange with the collector")
        return EXIT_OK
    except _Failed as exc:
        echo(f"ERROR {exc}")
        return exc.code
    finally:
        if own:
            http.close()
