"""A small HTTP client for the collector API (keep-alive httpx).

Used by the hook's streamer (inside the inference server) and by the CLI. It imports
neither torch nor anything of the collector: only httpx and the wire format.

Errors are typed so that callers decide once what to do with them:

* :class:`CollectorUnavailable` — connection refused/reset, timeout, or a 5xx answer:
  the request may succeed later (the streamer spools and retries).
* :class:`BatchRejected` — a 4xx answer (bad batch, unknown run, conflict, too big,
  auth): retrying the same request will not help (the streamer drops and counts it).
"""

from __future__ import annotations

import time
from typing import Any

import httpx

from shadowd.wire import MSGPACK, SENT_AT_HEADER

__all__ = ["BatchRejected", "CollectorClient", "CollectorError", "CollectorUnavailable", "url_problem"]


def url_problem(url: str) -> str | None:
    """Why ``url`` is no collector base URL (http or https, with a host), or None when it is one."""
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:
        return str(exc)
    if parsed.scheme not in ("http", "https") or not parsed.host:
        return "not an http:// or https:// URL with a host (e.g. http://127.0.0.1:8787)"
    return None


class CollectorError(Exception):
    """Base class of the client's errors."""


class CollectorUnavailable(CollectorError):
    """The collector could not be reached, answered 5xx, or asked to be called later (408, 429): try again later.
    ``status`` is the HTTP status (None when there was no answer)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


#: answers that say "later", not "never" (a proxy's timeout, rate limiting)
TRANSIENT_4XX = (408, 429)


class BatchRejected(CollectorError):
    """The collector refused the request (4xx); ``detail`` is its decoded ``detail``."""

    def __init__(self, status: int, detail: Any) -> None:
        super().__init__(f"HTTP {status}: {detail}")
        self.status = status
        self.detail = detail

    @property
    def unknown_producer_field(self) -> tuple[str, str] | None:
        """``("producer_stats" | "producer_notes", key)`` when the collector refused a batch for a producer figure
        it does not know (a collector older than the producer), else None."""
        d = self.detail if isinstance(self.detail, dict) else {}
        group, _, key = str(d.get("field", "")).partition(".")
        if (self.status != 422 or group not in ("producer_stats", "producer_notes") or not key
                or not str(d.get("error", "")).startswith("unknown field")):
            return None
        return group, key


def _detail(resp: httpx.Response) -> Any:
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:500]
    return body.get("detail", body) if isinstance(body, dict) else body


class CollectorClient:
    """Client for one collector. ``url`` is its base (``http://host:8787``).

    ``timeout`` bounds every request (connect, read, write, pool), so a collector that
    accepts and never answers costs the calling thread at most that long.
    """

    def __init__(self, url: str, token: str | None = None, timeout: float = 10.0,
                 transport: httpx.BaseTransport | None = None) -> None:
        if (why := url_problem(url)) is not None:
            raise ValueError(f"collector URL {url!r}: {why}")
        headers = {"User-Agent": "shadowd-hook"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self.url = url.rstrip("/")
        self._args = (url, token, timeout, transport)
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=httpx.Timeout(timeout),
                                  transport=transport)

    def fresh(self) -> CollectorClient:
        """A client like this one with connections of its own (a forked process must not share its parent's)."""
        return CollectorClient(*self._args)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> CollectorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, method: str, path: str, pass_503: bool = False, **kw: Any) -> httpx.Response:
        try:
            resp = self._http.request(method, path, **kw)
        except (httpx.TransportError, httpx.TimeoutException) as e:
            raise CollectorUnavailable(f"{method} {path}: {type(e).__name__}: {e}") from e
        if ((resp.status_code >= 500 or resp.status_code in TRANSIENT_4XX)
                and not (pass_503 and resp.status_code == 503)):
            raise CollectorUnavailable(f"{method} {path}: HTTP {resp.status_code}", resp.status_code)
        return resp

    def _json(self, method: str, path: str, ok: tuple[int, ...] = (200, 201), **kw: Any) -> Any:
        resp = self._request(method, path, **kw)
        if resp.status_code not in ok:
            raise BatchRejected(resp.status_code, _detail(resp))
        try:
            return resp.json()
        except ValueError as e:
            raise CollectorUnavailable(f"{method} {path}: answer is not JSON") from e

    def register_run(self, run: dict[str, Any]) -> dict[str, Any]:
        """``POST /v1/runs`` (idempotent on ``run_key``); returns the run, with ``id``."""
        out: dict[str, Any] = self._json("POST", "/v1/runs", json=run)
        return out

    def post_batch(self, run_id: int, body: bytes) -> dict[str, Any]:
        """``POST /v1/runs/{id}/samples`` with a msgpack-encoded wire batch."""
        out: dict[str, Any] = self._json("POST", f"/v1/runs/{run_id}/samples", ok=(200,), content=body,
                                         headers={"Content-Type": MSGPACK, SENT_AT_HEADER: f"{time.time():.3f}"})
        return out

    def set_mode(self, run_id: int, mode: str | None) -> dict[str, Any]:
        """``PUT /v1/runs/{id}/mode``: the kill switch (``validate``, ``off`` or None to clear)."""
        out: dict[str, Any] = self._json("PUT", f"/v1/runs/{run_id}/mode", ok=(200,), json={"mode": mode})
        return out

    def get_run(self, run_id: int) -> dict[str, Any]:
        """``GET /v1/runs/{id}``: the run, its ``mode_override`` and sample counts."""
        out: dict[str, Any] = self._json("GET", f"/v1/runs/{run_id}", ok=(200,))
        return out

    def health(self) -> dict[str, Any]:
        """``GET /healthz`` (raises :class:`CollectorUnavailable` while the collector is not up)."""
        out: dict[str, Any] = self._json("GET", "/healthz", ok=(200,))
        return out

    def readiness(self, run_id: int | None = None) -> tuple[int, dict[str, Any]]:
        """``GET /readiness``: (HTTP status, verdict body); 200 means READY, 503 not."""
        params = {"run_id": run_id} if run_id is not None else None
        resp = self._request("GET", "/readiness", pass_503=True, params=params)
        if resp.status_code not in (200, 503):
            raise BatchRejected(resp.status_code, _detail(resp))
        try:
            body = resp.json()
        except ValueError as e:
            if resp.status_code == 503:  # a proxy's 503, not the collector's verdict
                raise CollectorUnavailable("GET /readiness: HTTP 503 without a verdict") from e
            body = {"verdict": None, "raw": resp.text[:500]}
        return resp.status_code, body
