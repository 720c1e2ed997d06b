"""Runs: idempotent registration, conflicts, auth, restarts, retention."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import create_engine, insert, select

from shadowd.collector import tables as t
from shadowd.collector.app import create_app
from shadowd.collector.db import SchemaOutdated
from shadowd.collector.settings import CollectorSettings
from tests.collector.helpers import count_rows, post_msgpack, register
from tests.factories import make_batch, run_body


def test_registration_is_idempotent_on_run_key(db_url, make_client):
    c = make_client(db_url)
    body = run_body("rk-1")
    first = c.post("/v1/runs", json=body)
    again = c.post("/v1/runs", json=body)
    assert (first.status_code, again.status_code) == (201, 200)
    assert first.json()["id"] == again.json()["id"]
    clash = c.post("/v1/runs", json=run_body("rk-1", num_layers=61))
    assert clash.status_code == 409 and clash.json()["detail"]["field"] == "num_layers"
    new_build = c.post("/v1/runs", json=run_body("rk-1", candidate={"name": "k", "fingerprint": "other"}))
    assert new_build.status_code == 409
    assert [r["run_key"] for r in c.get("/v1/runs").json()] == ["rk-1"]


def test_auth_when_a_token_is_configured(fresh_sqlite, make_client):
    c = make_client(fresh_sqlite, token="s3cret")
    assert c.post("/v1/runs", json=run_body()).status_code == 401
    assert c.post("/v1/runs", json=run_body(), headers={"Authorization": "Bearer nope"}).status_code == 403
    run_id = register(c, run_body(), Authorization="Bearer s3cret")
    assert post_msgpack(c, run_id, make_batch(4)).status_code == 401
    assert post_msgpack(c, run_id, make_batch(4), Authorization="Bearer s3cret").status_code == 200
    assert c.get("/v1/runs").status_code == 401
    assert c.get("/readiness").status_code == 401
    assert c.get("/healthz").status_code == 200  # health checks need no token
    assert count_rows(fresh_sqlite, t.samples) == 4


def test_restarted_service_keeps_all_data(db_url, make_client):
    c = make_client(db_url)
    run_id = register(c, run_body("keep"))
    post_msgpack(c, run_id, make_batch(100, seq=0))
    c.__exit__(None, None, None)
    c2 = make_client(db_url, auto_upgrade=False)
    run = c2.get(f"/v1/runs/{run_id}").json()
    assert run["samples"] == 100 and run["run_key"] == "keep"
    # the producer's next batch continues the sequence, and a re-delivery is still a duplicate
    assert post_msgpack(c2, run_id, make_batch(100, seq=0)).json()["duplicate"] is True
    assert post_msgpack(c2, run_id, make_batch(100, seq=1, step0=1000)).json()["accepted"] == 100
    assert c2.get(f"/v1/runs/{run_id}").json()["samples"] == 200


def test_server_refuses_an_outdated_schema(fresh_sqlite):
    with pytest.raises(SchemaOutdated, match="shadowd db upgrade"):
        create_app(CollectorSettings(db_url=fresh_sqlite))


def test_retention_deletes_raw_samples_and_keeps_rollups(db_url, make_client):
    c = make_client(db_url)
    run_id = register(c, run_body(num_layers=2))
    now = time.time()
    old = make_batch(10, num_layers=2, seq=0, ts0=now - 10 * 86400)
    post_msgpack(c, run_id, old)
    post_msgpack(c, run_id, make_batch(10, num_layers=2, seq=1, ts0=now, step0=100))
    post_msgpack(c, run_id, make_batch(10, num_layers=2, seq=0, ts0=now - 9 * 86400, producer="p2"))
    store = c.app.state.shadowd.store
    assert store.prune_samples(now - 86400) == 20
    assert count_rows(db_url, t.samples) == 10
    assert store.prune_samples(now - 86400) == 0  # nothing twice
    # the batch rows were received just now: duplicate detection still knows them
    assert post_msgpack(c, run_id, old).json()["duplicate"] is True
    assert count_rows(db_url, t.batches) == 3
    # a later pass forgets the old batches too, and keeps the recent one with its samples
    assert store.prune_samples(time.time() + 3600) == 10
    assert count_rows(db_url, t.batches) == 0 and count_rows(db_url, t.samples) == 0
    layers = c.get(f"/v1/runs/{run_id}/layers").json()["layers"]
    assert sum(row["samples"] for row in layers) == 30


def test_healthz_and_first_readiness(db_url, make_client):
    c = make_client(db_url)
    assert c.get("/healthz").json()["status"] == "ok"
    assert c.get("/readiness").status_code == 404
    run_id = register(c, run_body())
    r = c.get("/readiness", params={"run_id": run_id})
    assert r.status_code == 503 and r.json()["verdict"] == "INSUFFICIENT_DATA"
    post_msgpack(c, run_id, make_batch(8, cand_nonfinite=[0, 0, 3, 0, 0, 0, 0, 0]))
    r = c.get("/readiness", params={"run_id": run_id})
    assert r.status_code == 503 and r.json()["verdict"] == "NOT_READY"


def test_database_restart_loses_nothing(fresh_pg, make_client):
    """Every server connection is killed (what a PostgreSQL restart does to the pool); ingest goes on."""
    import psycopg
    from sqlalchemy.engine import make_url

    c = make_client(fresh_pg)
    run_id = register(c, run_body())
    assert post_msgpack(c, run_id, make_batch(50, seq=0)).status_code == 200
    u = make_url(fresh_pg)
    with psycopg.connect(host=u.host, port=u.port or 5432, user=u.username, dbname="postgres",
                         autocommit=True) as admin:
        killed = admin.execute("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                               "WHERE datname = %s AND pid <> pg_backend_pid()", (u.database,)).fetchone()
    assert killed is not None
    r = post_msgpack(c, run_id, make_batch(50, seq=1, step0=100))
    if r.status_code == 503:  # a request may meet the dead connection once; the producer retries
        r = post_msgpack(c, run_id, make_batch(50, seq=1, step0=100))
    assert r.status_code == 200 and r.json()["duplicate"] is False
    assert c.get(f"/v1/runs/{run_id}").json()["samples"] == 100


def test_retention_keeps_each_runs_latest_evaluation_and_its_verdict_changes(db_url, make_client):
    """The cadence stores an evaluation (the whole report) every interval while a run takes batches: thousands of
    rows a day. Retention deletes those older than the window, except each run's latest (what /readiness serves
    and the next evaluation's hysteresis starts from) and the evaluations whose verdict differs from the one
    before (when the run became READY or NOT_READY stays answerable)."""
    c = make_client(db_url)
    a, b = register(c, run_body("a")), register(c, run_body("b"))
    now = time.time()
    day = 86400.0
    history = {a: ["INSUFFICIENT_DATA", "INSUFFICIENT_DATA", "READY", "READY", "READY", "NOT_READY", "NOT_READY"],
               b: ["INSUFFICIENT_DATA", "INSUFFICIENT_DATA"]}
    engine = create_engine(db_url)
    try:
        with engine.begin() as conn:
            for run_id, verdicts in history.items():
                for i, v in enumerate(verdicts):  # a day apart, the last ones 2 days old
                    conn.execute(insert(t.evaluations).values(
                        run_id=run_id, candidate_fingerprint="c", at=now - (len(verdicts) + 1 - i) * day,
                        verdict=v, passing=int(v == "READY"), policy_hash="p", report=f'{{"verdict": "{v}"}}'))
        # one recent evaluation of run a, inside the window: kept whatever it says
        with engine.begin() as conn:
            conn.execute(insert(t.evaluations).values(run_id=a, candidate_fingerprint="c", at=now - 60,
                                                      verdict="NOT_READY", passing=0, policy_hash="p",
                                                      report='{"verdict": "NOT_READY"}'))
        evaluator = c.app.state.evaluator
        assert evaluator.prune(now - day) == 4  # a: the 2nd, 4th, 5th and 7th; b: none (its 2nd is its latest)
        assert evaluator.prune(now - day) == 0  # nothing twice
        with engine.connect() as conn:
            kept = {r: [v for (v,) in conn.execute(select(t.evaluations.c.verdict)
                                                   .where(t.evaluations.c.run_id == r)
                                                   .order_by(t.evaluations.c.at))] for r in (a, b)}
    finally:
        engine.dispose()
    assert kept == {a: ["INSUFFICIENT_DATA", "READY", "NOT_READY", "NOT_READY"],
                    b: ["INSUFFICIENT_DATA", "INSUFFICIENT_DATA"]}
    assert evaluator.previous(b)["verdict"] == "INSUFFICIENT_DATA"
