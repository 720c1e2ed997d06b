"""A collector fed with a realistic run: samples over 40 minutes of producer time, exceedances on one
layer, a non-finite mismatch, a duplicate and a rejected batch, timing, producer health figures, and a
stored readiness evaluation — so every series the dashboard and the rules use exists."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
from fastapi import FastAPI
from sqlalchemy import insert

from shadowd.collector import tables as t
from shadowd.wire import SENT_AT_HEADER
from tests.factories import make_batch, run_body

__all__ = ["EVALUATION_REPORT", "NUM_LAYERS", "feed", "seed_run", "store_evaluation"]

NUM_LAYERS = 6
PER_BATCH = NUM_LAYERS * 40

EVALUATION_REPORT: dict[str, Any] = {
    "verdict": "NOT_READY",
    "reasons": [
        "1 calls with the candidate non-finite where the baseline is finite",
        "layer 4: rel-L2 beyond tolerance in 3.3% of steps",
    ],
    "criteria": [
        {"name": "no_nonfinite_mismatch", "observed": 1, "threshold": 0, "passed": False},
        {"name": "exceeding_step_rate_upper", "observed": 0.041, "threshold": 1e-4, "passed": False},
        {"name": "min_requests", "observed": 5120, "threshold": 1000, "passed": True},
        {"name": "layer_coverage", "observed": 6, "threshold": 6, "passed": True},
    ],
}


def _batch(
    seq: int,
    ts0: float,
    *,
    producer: str = "p-seed",
    rank: int = 0,
    bad_layer: int = 4,
    nonfinite: bool = False,
    spool: int = 0,
    dropped: int = 0,
) -> dict[str, Any]:
    n = PER_BATCH
    rel = [3e-3] * n
    for i in range(bad_layer, n, NUM_LAYERS * 10):  # one call in ten steps of bad_layer: beyond tolerance
        rel[i] = 4e-2
    cand_nonfinite = [0] * n
    if nonfinite:
        cand_nonfinite[1] = 3
    b = make_batch(
        n,
        num_layers=NUM_LAYERS,
        seq=seq,
        producer=producer,
        rank=rank,
        step0=seq * 40,
        ts0=ts0,
        seed=seq,
        rel_l2=3e-3,
        cand_us=[40.0] * n,
        base_us=[55.0] * n,
    )
    b["samples"]["rel_l2"] = rel
    b["samples"]["cand_nonfinite"] = cand_nonfinite
    b["samples"]["nan_cand"] = cand_nonfinite
    b["producer_stats"] = {"spool_depth": spool, "dropped": dropped, "fallback": 0, "disabled": 0,
                           # SGLang's speculative counters as the plugin reports them (cumulative)
                           "spec_accept_tokens_validate": 30 * (seq + 1), "spec_req_steps_validate": 10 * (seq + 1),
                           "spec_passes_validate": 5 * (seq + 1)}
    return b


def seed_run(client: httpx.Client | Any, minutes: int = 40, key: str = "seeded-run") -> int:
    """Register a run and post ``minutes`` batches one producer-minute apart; return the run id."""
    r = client.post("/v1/runs", json=run_body(key, num_layers=NUM_LAYERS))
    assert r.status_code in (200, 201), r.text
    run_id = int(r.json()["id"])
    start = time.time() - minutes * 60
    first: dict[str, Any] = {}
    for i in range(minutes):
        b = _batch(i, start + i * 60, nonfinite=(i == max(0, minutes - 5)), spool=i % 3)
        first = first or b
        # (stamped at send time like the hook's posts: the samples are old, the clock is not)
        sent = {SENT_AT_HEADER: f"{time.time():.3f}"}
        assert client.post(f"/v1/runs/{run_id}/samples", json=b, headers=sent).status_code == 200
    dup = client.post(f"/v1/runs/{run_id}/samples", json=first)
    assert dup.json()["duplicate"] is True
    bad = client.post(f"/v1/runs/{run_id}/samples", json={"producer": "p-seed", "seq": "x", "samples": {}})
    assert bad.status_code == 422, bad.text
    return run_id


def feed(client: httpx.Client | Any, run_id: int, seq: int, producer: str = "p-live") -> None:
    """One more batch of live traffic (a second rank, reporting a spool and drops)."""
    # its 40 steps end now (make_batch stamps step s at ts0 + s · 0.05 s, and this batch's steps start at seq · 40)
    b = _batch(seq, time.time() - 0.05 * 40 * (seq + 1), producer=producer, rank=0, spool=5 + seq, dropped=seq)
    # stamped like the hook's client stamps every post (the rank's clock offset)
    sent = {SENT_AT_HEADER: f"{time.time():.3f}"}
    assert client.post(f"/v1/runs/{run_id}/samples", json=b, headers=sent).status_code == 200


def store_evaluation(app: FastAPI, run_id: int, report: dict[str, Any] | None = None) -> None:
    """Store an evaluation as the readiness evaluator does, and publish its verdict gauge."""
    report = report or EVALUATION_REPORT
    state = app.state.shadowd
    with state.engine.begin() as conn:
        conn.execute(
            insert(t.evaluations).values(
                run_id=run_id,
                candidate_fingerprint="build-abc123",
                at=time.time(),
                verdict=report["verdict"],
                passing=0,
                policy_hash=state.policy.identity(),
                report=json.dumps(report),
            )
        )
    app.state.metrics.set_verdict(run_id, "kdtree-verify", report["verdict"], True)
