"""Every kind of bad batch is a 4xx naming the field, and stores nothing."""

from __future__ import annotations

import json
import time

import orjson
import pytest
from sqlalchemy import create_engine, func, select

from shadowd.collector import tables as t
from shadowd.collector.routers import samples as samples_router
from shadowd.wire import COUNTER_MAX, HIST_BINS
from tests.collector.helpers import TABLES, count_rows, post_msgpack, register
from tests.factories import make_batch, run_body


def _nothing_stored(db_url: str) -> None:
    for table in TABLES:
        assert count_rows(db_url, table) == 0, table.name


def _cases():
    def with_value(col, i, value):
        def make():
            b = make_batch(6)
            b["samples"][col][i] = value
            return b
        return make

    def without(col):
        def make():
            b = make_batch(6)
            del b["samples"][col]
            return b
        return make

    def short(col):
        def make():
            b = make_batch(6)
            b["samples"][col] = b["samples"][col][:-1]
            return b
        return make

    def bad_hist():
        b = make_batch(6)
        b["samples"]["hist"][1] = [0] * (HIST_BINS - 1)
        return b

    return [
        ("wrong type", with_value("max_abs", 2, "big"), 422, "samples.max_abs[2]"),
        ("string count", with_value("nan_cand", 1, "3"), 422, "samples.nan_cand[1]"),
        ("missing field", without("rel_l2"), 422, "samples.rel_l2"),
        ("negative count", with_value("nan_base", 4, -1), 422, "samples.nan_base[4]"),
        ("NaN where a count belongs", with_value("inf_cand", 3, float("nan")), 422, "samples.inf_cand[3]"),
        ("float count", with_value("numel", 0, 1.5), 422, "samples.numel[0]"),
        ("negative statistic", with_value("rel_l2", 5, -0.1), 422, "samples.rel_l2[5]"),
        ("infinite timestamp", with_value("ts", 0, float("inf")), 422, "samples.ts[0]"),
        ("layer beyond the run", with_value("layer", 2, 99), 422, "samples.layer[2]"),
        ("rank beyond tp_size", with_value("rank", 0, 3), 422, "samples.rank[0]"),
        ("ragged columns", short("heads"), 422, "samples.heads"),
        ("bad histogram", bad_hist, 422, "samples.hist[1]"),
        ("unknown column", lambda: {**make_batch(6), "samples": {**make_batch(6)["samples"], "maxabs": [0] * 6}},
         422, "samples.maxabs"),
        ("bad mode", lambda: make_batch(6, mode="shadow"), 422, "samples.mode[0]"),
        ("no producer", lambda: {k: v for k, v in make_batch(6).items() if k != "producer"}, 422, "producer"),
        ("negative seq", lambda: make_batch(6, seq=-1), 422, "seq"),
        ("empty batch", lambda: {"producer": "p", "seq": 0, "samples": {c: [] for c in make_batch(1)["samples"]}},
         422, "samples"),
        ("bad producer stats", lambda: {**make_batch(6), "producer_stats": {"spool_depth": -2}}, 422,
         "producer_stats.spool_depth"),
        # beyond 64 bits the database refused them (SQLite 500, PostgreSQL 503: the producer retried forever)
        ("producer stat of 2^63", lambda: {**make_batch(6), "producer_stats": {"device_errors": 2**63}}, 422,
         "producer_stats.device_errors"),
        ("producer stat of 2^64 - 1", lambda: {**make_batch(6), "producer_stats": {"dropped": 2**64 - 1}}, 422,
         "producer_stats.dropped"),
        ("producer stat beyond 2^53", lambda: {**make_batch(6), "producer_stats": {"spec_passes_on": COUNTER_MAX + 1}},
         422, "producer_stats.spec_passes_on"),
        ("unknown producer note", lambda: {**make_batch(6), "producer_notes": {"why": "x"}}, 422, "producer_notes.why"),
        ("overlong producer note", lambda: {**make_batch(6), "producer_notes": {"disabled_reason": "x" * 301}}, 422,
         "producer_notes.disabled_reason"),
        # bounds that keep the rollups' sums and time buckets exact (each was a 500 or a corrupt rollup before)
        ("timestamp in milliseconds", with_value("ts", 0, 1.7e12), 422, "samples.ts[0]"),
        ("timestamps centuries apart", with_value("ts", 1, 1e20), 422, "samples.ts[1]"),
        ("timestamp an hour ahead of the collector's clock", lambda: with_value("ts", 3, time.time() + 3600)(),
         422, "samples.ts[3]"),
        ("step beyond 2^53", with_value("step", 1, 2**62), 422, "samples.step[1]"),
        ("numel beyond 2^48", with_value("numel", 2, 2**63 - 1), 422, "samples.numel[2]"),
        # their power-of-two shape bucket is a 32-bit column: 2^30 + 1 has bucket 2^31 (SQLite stored it, PostgreSQL
        # refused the batch naming only "samples")
        ("batch size whose bucket is beyond 32 bits", with_value("batch_size", 1, 2**30 + 1), 422,
         "samples.batch_size[1]"),
        ("draft tokens whose bucket is beyond 32 bits", with_value("draft_tokens", 3, 2**31 - 1), 422,
         "samples.draft_tokens[3]"),
        # NUL characters: PostgreSQL text cannot hold them (it answered 503 "retry later")
        ("NUL in an error string", lambda: {**make_batch(6), "samples": {
            **make_batch(6)["samples"], "error": [None, "bad\x00err", None, None, None, None]}}, 422,
         "samples.error[1]"),
        ("NUL in the producer", lambda: {**make_batch(6), "producer": "p\x001"}, 422, "producer"),
        ("NUL in a producer note", lambda: {**make_batch(6), "producer_notes": {"disabled_reason": "x\x00y"}}, 422,
         "producer_notes.disabled_reason"),
        # device times beyond an hour: their sums overflowed (PostgreSQL refused a later, valid batch; SQLite stored
        # an infinite sum and /readiness answered 500 for the run from then on)
        ("candidate time of 1e308 µs", lambda: {**make_batch(6), "samples": {
            **make_batch(6)["samples"], "cand_us": [1.0, 2.0, 1e308, 1.0, 1.0, 1.0]}}, 422, "samples.cand_us[2]"),
        ("baseline time beyond an hour", lambda: {**make_batch(6), "samples": {
            **make_batch(6)["samples"], "base_us": [3.6e9 + 1] + [1.0] * 5}}, 422, "samples.base_us[0]"),
        # booleans among numbers (numpy would read true as 1 and store it)
        ("boolean among counts", with_value("nan_cand", 2, True), 422, "samples.nan_cand[2]"),
        ("boolean among statistics", with_value("max_abs", 3, True), 422, "samples.max_abs[3]"),
        ("boolean in a histogram", lambda: {**make_batch(6), "samples": {
            **make_batch(6)["samples"], "hist": [[0] * HIST_BINS] * 4 + [[True] + [0] * (HIST_BINS - 1)]
            + [[0] * HIST_BINS]}}, 422, "samples.hist[4]"),
        # a column longer than the rest is the one named (the next column was blamed)
        ("first column too long", lambda: {**make_batch(6), "samples": {
            **make_batch(6)["samples"], "layer": make_batch(6)["samples"]["layer"] + [0]}}, 422, "samples.layer"),
    ]


@pytest.mark.parametrize("name,make,status,field", _cases(), ids=[c[0] for c in _cases()])
def test_bad_batch_names_the_field_and_stores_nothing(fresh_sqlite, make_client, name, make, status, field):
    c = make_client(fresh_sqlite)
    run_id = register(c, run_body(num_layers=4, tp_size=1))
    r = post_msgpack(c, run_id, make())
    assert r.status_code == status, r.text
    assert r.json()["detail"]["field"] == field
    assert r.json()["detail"]["error"]
    _nothing_stored(fresh_sqlite)
    reg = c.app.state.metrics.registry
    assert reg.get_sample_value("shadowd_rejected_batches_total", {"status": str(status)}) == 1


def test_rejections_store_nothing_on_postgres(fresh_pg, make_client):
    c = make_client(fresh_pg)
    run_id = register(c, run_body(num_layers=4))
    for _, make, status, field in _cases():
        r = post_msgpack(c, run_id, make())
        assert (r.status_code, r.json()["detail"]["field"]) == (status, field)
    _nothing_stored(fresh_pg)


def test_a_bad_sample_late_in_a_batch_rolls_back_the_whole_batch(db_url, make_client):
    c = make_client(db_url)
    run_id = register(c, run_body(num_layers=4))
    b = make_batch(500)
    b["samples"]["layer"][499] = 4
    assert post_msgpack(c, run_id, b).status_code == 422
    _nothing_stored(db_url)


def test_unknown_run_oversized_body_and_garbage(fresh_sqlite, make_client):
    c = make_client(fresh_sqlite, max_body_bytes=4096)
    r = post_msgpack(c, 999, make_batch(2))
    assert r.status_code == 404 and r.json()["detail"]["field"] == "run_id"
    r = post_msgpack(c, 999, make_batch(2, seq=-1))  # bad too: the unknown run is what is answered
    assert r.status_code == 404 and r.json()["detail"]["field"] == "run_id"
    run_id = register(c, run_body())
    big = post_msgpack(c, run_id, make_batch(200))
    assert big.status_code == 413 and big.json()["detail"]["field"] == "body"
    reg = c.app.state.metrics.registry  # refused before its body was read, and still counted
    assert reg.get_sample_value("shadowd_rejected_batches_total", {"status": "413"}) == 1
    junk = c.post(f"/v1/runs/{run_id}/samples", content=b"\xc1\xc1", headers={"content-type": "application/msgpack"})
    assert junk.status_code == 400 and junk.json()["detail"]["field"] == "body"
    text = c.post(f"/v1/runs/{run_id}/samples", content=b"x", headers={"content-type": "text/plain"})
    assert text.status_code == 415
    _nothing_stored(fresh_sqlite)


def test_bad_run_registration_names_the_field(fresh_sqlite, make_client):
    c = make_client(fresh_sqlite)
    r = c.post("/v1/runs", json=run_body(num_layers=0))
    assert r.status_code == 422 and r.json()["detail"]["field"] == "num_layers"
    body = run_body()
    del body["candidate"]
    r = c.post("/v1/runs", json=body)
    assert r.status_code == 422 and r.json()["detail"]["field"] == "candidate"
    assert count_rows(fresh_sqlite, t.runs) == 0


def test_bad_run_values_are_refused_and_store_nothing(fresh_sqlite, make_client):
    c = make_client(fresh_sqlite, max_body_bytes=4096)
    cases = [
        (run_body(started_at="inf"), 422, "started_at"),  # was stored, then a 500 on every read of it
        (run_body(started_at=1e308), 422, "started_at"),
        (run_body(num_layers="4"), 422, "num_layers"),
        (run_body(num_layers=True), 422, "num_layers"),
        (run_body(key="k\x00nul"), 422, "run_key"),
        (run_body(labels={f"k{i}": "v" for i in range(65)}), 422, "labels"),
        (run_body(labels={"note": "x\x00y"}), 422, "labels"),
    ]
    for body, status, field in cases:
        r = c.post("/v1/runs", json=body)
        assert (r.status_code, r.json()["detail"]["field"]) == (status, field), (body, r.text)
    big = c.post("/v1/runs", json=run_body(labels={f"k{i}": "v" * 400 for i in range(20)}))
    assert big.status_code == 413 and big.json()["detail"]["field"] == "body"  # every route has the body limit
    bad_json = c.post("/v1/runs", content=b'{"run_key": ', headers={"content-type": "application/json"})
    assert bad_json.status_code == 400 and bad_json.json()["detail"]["field"] == "body"
    assert "not valid JSON at byte" in bad_json.json()["detail"]["error"]
    assert count_rows(fresh_sqlite, t.runs) == 0


def test_labels_that_are_not_unicode_are_refused_and_store_nothing(db_url, make_client):
    """A lone surrogate (``\\udfff`` in the JSON) in a label key or value is no text either database can store as
    such: 422 naming ``labels``. (It was stored, answered 500, and every later ``GET /v1/runs`` was a 500 too.)"""
    c = make_client(db_url)
    for labels in ({"note": "x\udfffy"}, {"k\ud800": "v"}):
        r = c.post("/v1/runs", content=json.dumps(run_body(labels=labels)),
                   headers={"content-type": "application/json"})
        assert (r.status_code, r.json()["detail"]["field"]) == (422, "labels"), r.text
    assert count_rows(db_url, t.runs) == 0
    assert c.get("/v1/runs").status_code == 200
    assert c.post("/v1/runs", json=run_body(labels={"note": "ünïcode ✓ 😀"})).status_code == 201


def test_ids_beyond_64_bits_and_content_types(fresh_sqlite, make_client):
    c = make_client(fresh_sqlite)
    run_id = register(c, run_body())
    huge = 2**63
    for method, path in (("GET", f"/v1/runs/{huge}"), ("GET", f"/v1/runs/{huge}/layers"),
                         ("GET", f"/readiness/{huge}/layers"), ("GET", f"/readiness?run_id={huge}"),
                         ("GET", f"/v1/runs?offset={huge}"), ("PUT", f"/v1/runs/{huge}/mode")):
        r = c.request(method, path, json={"mode": "off"} if method == "PUT" else None)
        assert r.status_code == 422 and r.json()["detail"]["field"] in ("run_id", "offset"), (path, r.text)
    assert post_msgpack(c, huge, make_batch(2)).status_code == 422
    body = orjson.dumps(make_batch(3), option=orjson.OPT_SERIALIZE_NUMPY)
    odd = c.post(f"/v1/runs/{run_id}/samples", content=body, headers={"content-type": "application/jsonx"})
    assert odd.status_code == 415 and odd.json()["detail"]["field"] == "content-type"
    _nothing_stored(fresh_sqlite)
    plain = c.post(f"/v1/runs/{run_id}/samples", content=body,
                   headers={"content-type": "application/json; charset=utf-8"})
    assert plain.status_code == 200, plain.text


def test_bad_run_values_store_nothing_on_postgres(fresh_pg, make_client):
    c = make_client(fresh_pg)
    for body in (run_body(key="k\x00nul"), run_body(started_at="inf")):
        r = c.post("/v1/runs", json=body)
        assert r.status_code == 422, r.text  # (NUL was a 503 "retry later" on PostgreSQL)
    assert count_rows(fresh_pg, t.runs) == 0


def test_the_largest_shapes_validation_accepts_are_stored(db_url, make_client):
    """The largest batch size, tree size, prefix and head count that validation lets through are stored, with their
    shape buckets, on both databases (a bucket must fit its 32-bit column)."""
    c = make_client(db_url, ingest_writer="inline")
    run_id = register(c, run_body(num_layers=4))
    b = make_batch(4)
    for col, value in (("batch_size", 2**30), ("draft_tokens", 2**30), ("prefix_len", 2**31 - 1),
                       ("heads", 2**31 - 1)):
        b["samples"][col] = [value] * 4
    r = post_msgpack(c, run_id, b)
    assert r.status_code == 200 and r.json()["accepted"] == 4, r.text
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            top = conn.execute(select(func.max(t.cells.c.bs_bucket), func.max(t.cells.c.t_bucket),
                                      func.max(t.cells.c.prefix_bucket), func.max(t.cells.c.heads))).one()
    finally:
        engine.dispose()
    assert tuple(top) == (2**30, 2**30, 31, 2**31 - 1)


def _database_rule(db_url: str, table: str, check: str) -> None:
    """A rule of the database's own that validation does not know: the rows of ``table`` must pass ``check``
    (``{row}`` before each column; SQLite: triggers, PostgreSQL: a CHECK constraint)."""
    engine = create_engine(db_url)
    try:
        with engine.begin() as conn:
            if engine.dialect.name == "sqlite":
                for event in ("INSERT", "UPDATE"):
                    conn.exec_driver_sql(f"CREATE TRIGGER rule_{event.lower()} BEFORE {event} ON {table} "
                                         f"WHEN NOT ({check.format(row='NEW.')}) BEGIN SELECT RAISE(ABORT, "
                                         "'against the rule'); END")
            else:
                conn.exec_driver_sql(f"ALTER TABLE {table} ADD CONSTRAINT rule CHECK ({check.format(row='')})")
    finally:
        engine.dispose()


@pytest.mark.parametrize("refusal", ["out of range", "constraint"])
@pytest.mark.parametrize("ingest_writer", ["process", "inline"])
def test_a_value_the_database_refuses_is_422_and_stores_nothing(db_url, make_client, monkeypatch, refusal,
                                                                 ingest_writer):
    """A value that passes validation but that the database refuses — out of its range (SQLite's driver:
    OverflowError, PostgreSQL: DataError) or against a constraint (IntegrityError) — is the batch's fault: 422
    naming what was refused, nothing stored, counted as rejected; never 500, nor 503 "retry later" (the producer
    would re-send it forever). In the writer process and in the request thread, on both databases."""
    c = make_client(db_url, ingest_writer=ingest_writer)
    assert (c.app.state.shadowd.writer is not None) == (ingest_writer == "process")
    run_id = register(c, run_body(num_layers=4))
    if refusal == "out of range":  # a figure beyond 64 bits, as if validation had let it through
        parse = samples_router.parse_batch

        def lax_parse(body):
            batch = parse(body)
            if batch.seq == 0:
                batch.producer_stats["device_errors"] = 2**63
            return batch

        monkeypatch.setattr(samples_router, "parse_batch", lax_parse)
        bad = make_batch(6, packed=True)
    else:
        _database_rule(db_url, "producers", "{row}device_errors <= 1000")
        bad = {**make_batch(6, packed=True), "producer_stats": {"device_errors": 5000}}
    r = post_msgpack(c, run_id, bad)
    assert r.status_code == 422, r.text
    assert r.json()["detail"]["field"] == "producer_stats"
    assert "refused" in r.json()["detail"]["error"]
    _nothing_stored(db_url)
    run = c.get(f"/v1/runs/{run_id}").json()
    assert (run["batches"], run["samples"]) == (0, 0)
    reg = c.app.state.metrics.registry
    assert reg.get_sample_value("shadowd_rejected_batches_total", {"status": "422"}) == 1
    # nothing is wedged: the producer's next batch is stored
    good = {**make_batch(6, seq=1, step0=10, packed=True), "producer_stats": {"device_errors": 3}}
    r = post_msgpack(c, run_id, good)
    assert r.status_code == 200 and r.json()["accepted"] == 6, r.text
    assert count_rows(db_url, t.samples) == 6


def test_a_run_value_the_database_refuses_is_422(db_url, make_client):
    """Against a constraint of the database (IntegrityError) a run registration is 422 too, not 503."""
    c = make_client(db_url)
    _database_rule(db_url, "runs", "{row}model <> 'refused-model'")
    r = c.post("/v1/runs", json=run_body(model="refused-model"))
    assert r.status_code == 422, r.text
    assert r.json()["detail"]["field"] == "body" and "refused" in r.json()["detail"]["error"]
    assert count_rows(db_url, t.runs) == 0
    assert c.post("/v1/runs", json=run_body()).status_code == 201


def test_sample_times_ahead_of_the_collector_clock_are_refused_past_ones_kept(fresh_sqlite, make_client):
    """A producer clock running ahead would put samples in the future of every recency window: beyond
    SHADOWD_MAX_CLOCK_SKEW_S (300 s) ahead of the collector's receive time, 422 naming the sample. A batch
    replayed from a spool hours late is accepted."""
    c = make_client(fresh_sqlite)
    run_id = register(c, run_body(num_layers=4))
    now = time.time()
    ahead = make_batch(8, ts0=now - 1)
    ahead["samples"]["ts"][5] = now + 400
    r = post_msgpack(c, run_id, ahead)
    assert r.status_code == 422 and r.json()["detail"]["field"] == "samples.ts[5]"
    assert "ahead of the collector's clock" in r.json()["detail"]["error"]
    _nothing_stored(fresh_sqlite)
    assert post_msgpack(c, run_id, make_batch(8, seq=1, ts0=now + 200)).status_code == 200  # within the skew
    assert post_msgpack(c, run_id, make_batch(8, seq=2, ts0=now - 6 * 3600)).status_code == 200  # spooled
    strict = make_client(fresh_sqlite, max_clock_skew_s=10)
    assert post_msgpack(strict, run_id, make_batch(8, seq=3, ts0=time.time() + 60)).status_code == 422


def test_a_near_zero_candidate_time_beside_a_long_baseline_leaves_readiness_answering(db_url, make_client):
    # the speed-up's ratio overflows to inf: it is reported as unknown, and /readiness keeps answering
    c = make_client(db_url)
    run_id = register(c, run_body(num_layers=4, tp_size=1))
    b = make_batch(6)
    b["samples"]["cand_us"] = [1e-300] * 6
    b["samples"]["base_us"] = [3.6e9] * 6
    assert post_msgpack(c, run_id, b).status_code == 200
    r = c.get("/readiness", params={"run_id": run_id})
    assert r.status_code in (200, 503), r.text
    assert r.json()["timing"]["speedup"] is None


def test_a_stats_only_batch_may_carry_empty_columns_of_every_kind(db_url, make_client):
    # wire: a batch whose columns are all empty is stats-only, whatever the columns' kinds (integer ones were
    # refused as "must be a list of integers": numpy makes an empty list a float array)
    c = make_client(db_url)
    run_id = register(c, run_body(num_layers=4, tp_size=1))
    assert post_msgpack(c, run_id, make_batch(2)).status_code == 200
    empty = {"producer": make_batch(1)["producer"], "seq": 1, "producer_stats": {"dropped": 3},
             "samples": {col: [] for col in make_batch(1)["samples"]}}
    r = post_msgpack(c, run_id, empty)
    assert r.status_code == 200, r.text
    assert r.json()["accepted"] == 0
