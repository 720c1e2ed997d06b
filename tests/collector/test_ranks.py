"""Every TP rank of a run must report: rank coverage from rollup_ranks, on SQLite and the real PostgreSQL."""

from __future__ import annotations

from sqlalchemy import create_engine, select, text

from shadowd.collector import tables as t
from shadowd.collector.db import downgrade, upgrade
from tests.collector.helpers import post_msgpack, register
from tests.factories import make_batch, run_body


def _criterion(report: dict, name: str) -> dict:
    return next(c for c in report["criteria"] if c["name"] == name)


def test_a_rank_that_never_reports_is_named_in_coverage(db_url, make_client):
    c = make_client(db_url)
    run_id = register(c, run_body(num_layers=2, tp_size=4))
    for rank in (0, 1):  # ranks 2 and 3 never report
        batch = make_batch(400, num_layers=2, rank=rank, producer=f"p{rank}", seq=0)
        assert post_msgpack(c, run_id, batch).status_code == 200
    report = c.get("/readiness", params={"run_id": run_id}).json()
    cov = _criterion(report, "coverage")
    assert cov["status"] == "insufficient" and cov["observed"]["ranks_without_samples"] == [2, 3]
    assert "rank 2, 3: no samples" in cov["detail"]
    assert any("rank 2, 3: no samples" in r for r in report["reasons"])

    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(select(t.ranks.c.rank, t.ranks.c.layer, t.ranks.c.n)
                                .where(t.ranks.c.run_id == run_id).order_by(t.ranks.c.rank, t.ranks.c.layer)).all()
    finally:
        engine.dispose()
    assert [tuple(r) for r in rows] == [(0, 0, 200), (0, 1, 200), (1, 0, 200), (1, 1, 200)]

    # rank 2 reports one layer only, rank 3 everything: rank 2's missing layer is named, rank 3 is covered
    assert post_msgpack(c, run_id, make_batch(100, num_layers=1, rank=2, producer="p2")).status_code == 200
    assert post_msgpack(c, run_id, make_batch(400, num_layers=2, rank=3, producer="p3")).status_code == 200
    cov = _criterion(c.app.state.evaluator.evaluate(run_id), "coverage")
    assert cov["observed"]["ranks_without_samples"] == [] and cov["observed"]["ranks_short"] == [2]
    assert cov["detail"] == "rank 2: 1 of 2 layers below 100 compared samples (layers 1)"
    assert post_msgpack(c, run_id, make_batch(200, num_layers=2, rank=2, producer="p2", seq=1,
                                              step0=100)).status_code == 200
    cov = _criterion(c.app.state.evaluator.evaluate(run_id), "coverage")
    assert cov["status"] == "pass", cov["detail"]


def test_migration_0006_fills_rank_rollups_from_what_is_stored(db_url):
    """A run of one rank from its cells; a run of several ranks from its raw samples."""
    upgrade(db_url, "0005")
    engine = create_engine(db_url)
    insert_run = ("INSERT INTO runs (run_key, model, num_layers, tp_size, candidate_name, candidate_fingerprint, "
                  "baseline_name, baseline_fingerprint, labels, started_at, created_at) VALUES "
                  "(:k, 'm', 2, :tp, 'c', 'fc', 'b', 'fb', '{}', 0, 0) RETURNING id")
    try:
        with engine.begin() as conn:
            one = conn.execute(text(insert_run), {"k": "one", "tp": 1}).scalar_one()
            two = conn.execute(text(insert_run), {"k": "two", "tp": 2}).scalar_one()
            conn.execute(text("INSERT INTO rollup_cells (run_id, layer, bs_bucket, t_bucket, prefix_bucket, heads, n, "
                              "first_ts, last_ts) VALUES (:r, :l, :b, 8, 13, 8, :n, 10, 20)"),
                         [{"r": one, "l": 0, "b": 1, "n": 30}, {"r": one, "l": 0, "b": 4, "n": 12},
                          {"r": one, "l": 1, "b": 1, "n": 5}])
            batch = conn.execute(text("INSERT INTO batches (run_id, producer, seq, digest, n_samples, received_at, "
                                      "max_ts) VALUES (:r, 'p', 0, 'd', 3, 0, 40) RETURNING id"),
                                 {"r": two}).scalar_one()
            conn.execute(text("INSERT INTO samples (batch_id, rank, layer, step, call, ts, batch_size, draft_tokens, "
                              "prefix_len, heads, numel, hist) VALUES (:b, :rank, 0, 0, 0, :ts, 1, 1, 1, 8, :numel, "
                              ":h)"),
                         [{"b": batch, "rank": 1, "ts": 30.0, "numel": 64, "h": b"\x01" + bytes(40)},
                          {"b": batch, "rank": 1, "ts": 40.0, "numel": 0, "h": b"\x01" + bytes(40)},
                          {"b": batch, "rank": 0, "ts": 35.0, "numel": 64, "h": b"\x01" + bytes(40)}])
        upgrade(db_url)
        with engine.connect() as conn:
            rows = conn.execute(text("SELECT run_id, rank, layer, n, n_empty, first_ts, last_ts FROM rollup_ranks "
                                     "ORDER BY run_id, rank, layer")).all()
        assert [tuple(r) for r in rows] == [(one, 0, 0, 42, 0, 10.0, 20.0), (one, 0, 1, 5, 0, 10.0, 20.0),
                                            (two, 0, 0, 1, 0, 35.0, 35.0), (two, 1, 0, 1, 1, 30.0, 40.0)]
        downgrade(db_url, "0005")
        with engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM rollup_cells")).scalar_one() == 3
    finally:
        engine.dispose()


def test_a_producer_that_disabled_its_candidate_makes_the_run_not_ready(db_url, make_client, tmp_path):
    """Rank 1's hook disabled the candidate and its error samples never arrived: NOT_READY, naming the rank and
    the hook's note, at once and for the rest of the run (its restarted process reports clean batches)."""
    policy = tmp_path / "p.toml"
    policy.write_text("min_requests = 0\nmin_span_s = 0\nmin_cell_samples = 1\nhysteresis_k = 1\n"
                      "hysteresis_minutes = 0\ntarget_rate = 0.5\nconfidence = 0.6\ndrift_min_samples = 1\n")
    c = make_client(db_url, policy_file=policy)
    run_id = register(c, run_body(num_layers=2, tp_size=2))
    other = register(c, run_body(num_layers=2, tp_size=2))
    for rank in (0, 1):
        assert post_msgpack(c, run_id, make_batch(40, num_layers=2, rank=rank, producer=f"p{rank}")).status_code == 200
    first = c.get("/readiness", params={"run_id": run_id}).json()
    assert next(x for x in first["criteria"] if x["name"] == "producers")["status"] == "pass"
    note = "5 consecutive candidate errors (exception:RuntimeError)"
    gave_up = {**make_batch(40, num_layers=2, rank=1, producer="p1", seq=1, step0=20),
               "producer_stats": {"disabled": 1}, "producer_notes": {"disabled_reason": note}}
    assert post_msgpack(c, run_id, gave_up).status_code == 200
    report = c.get("/readiness", params={"run_id": run_id}).json()
    assert report["verdict"] == "NOT_READY"
    crit = next(x for x in report["criteria"] if x["name"] == "producers")
    assert crit["status"] == "fail" and crit["detail"] == f"rank 1 (producer p1): candidate disabled: {note}"
    assert f"producers: FAIL: rank 1 (producer p1): candidate disabled: {note}" in report["reasons"]
    # the rank restarts (a new producer) and reports clean batches: still NOT_READY
    restarted = make_batch(40, num_layers=2, rank=1, producer="p1-restarted", step0=40)
    assert post_msgpack(c, run_id, restarted).status_code == 200
    assert c.app.state.evaluator.evaluate(run_id)["verdict"] == "NOT_READY"
    # a fallback without a note is named too; another run's producers do not count
    fell = {**make_batch(40, num_layers=2, rank=0, producer="q0"), "producer_stats": {"fallback": 1}}
    assert post_msgpack(c, other, fell).status_code == 200
    assert next(x for x in c.app.state.evaluator.evaluate(run_id)["criteria"]
                if x["name"] == "producers")["detail"] == crit["detail"]
    crit = next(x for x in c.app.state.evaluator.evaluate(other)["criteria"] if x["name"] == "producers")
    assert crit["detail"] == "rank 0 (producer q0): on mode fell back to the baseline: no reason reported"
