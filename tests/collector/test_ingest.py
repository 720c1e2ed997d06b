"""Ingest against SQLite and the real PostgreSQL: rows, rollups, duplicates, gaps, metrics."""

from __future__ import annotations

import math

import numpy as np
import orjson
from sqlalchemy import create_engine, select

from shadowd.collector import tables as t
from tests.collector.helpers import count_rows, post_msgpack, register, sample_rows
from tests.factories import make_batch, run_body


def test_ingest_stores_rows_and_rollups(db_url, make_client):
    c = make_client(db_url)
    run_id = register(c, run_body(num_layers=4))
    batch = make_batch(400, num_layers=4, seed=1)
    r = post_msgpack(c, run_id, batch)
    assert r.status_code == 200, r.text
    assert r.json() == {"run_id": run_id, "accepted": 400, "duplicate": False, "mode_override": None}

    assert count_rows(db_url, t.samples, run_id=run_id) == 400
    engine = create_engine(db_url)
    with engine.connect() as conn:
        cells = [dict(x) for x in conn.execute(select(t.cells).where(t.cells.c.run_id == run_id)).mappings()]
        steps = conn.execute(select(t.steps).where(t.steps.c.run_id == run_id)).all()
    engine.dispose()
    assert sum(x["n"] for x in cells) == 400
    rel = np.array(batch["samples"]["rel_l2"])
    assert math.isclose(sum(x["sum_rel_l2"] for x in cells), rel.sum(), rel_tol=1e-9)
    assert math.isclose(max(x["max_rel_l2"] for x in cells), rel.max(), rel_tol=1e-12)
    assert {x["layer"] for x in cells} == {0, 1, 2, 3}
    assert len(steps) == 100 and all(s.n_calls == 4 for s in steps)

    run = c.get(f"/v1/runs/{run_id}").json()
    assert run["samples"] == 400 and run["batches"] == 1 and run["exceeded_calls"] == 0
    layers = c.get(f"/v1/runs/{run_id}/layers").json()
    assert [row["layer"] for row in layers["layers"]] == [0, 1, 2, 3]
    assert layers["missing_layers"] == []
    assert sum(row["samples"] for row in layers["layers"]) == 400


def test_shape_buckets_far_apart_in_one_batch_are_rolled_up_exactly(db_url, make_client):
    """Shapes at both ends of what validation accepts, in one batch: each call lands in its own shape bucket (the
    key of a cell was packed into one int64, which overflowed: cells of shapes no call had, counts mixed up)."""
    c = make_client(db_url, ingest_writer="inline")
    run_id = register(c, run_body(num_layers=4))
    shapes = [(1, 1, 0, 1), (2**30, 2**30, 2**31 - 1, 2**31 - 1), (3, 5, 1000, 7), (2**30, 1, 0, 2**31 - 1)]
    n = 8
    batch = make_batch(n, num_layers=4)
    s = batch["samples"]
    for i in range(n):
        s["batch_size"][i], s["draft_tokens"][i], s["prefix_len"][i], s["heads"][i] = shapes[i % len(shapes)]

    def pow2(x: int) -> int:
        return 1 << (max(x, 1) - 1).bit_length()

    expected: dict[tuple[int, ...], int] = {}
    for i in range(n):
        key = (s["layer"][i], pow2(s["batch_size"][i]), pow2(s["draft_tokens"][i]),
               int(s["prefix_len"][i]).bit_length(), s["heads"][i])
        expected[key] = expected.get(key, 0) + 1
    assert post_msgpack(c, run_id, batch).status_code == 200
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            cells = conn.execute(select(t.cells.c.layer, t.cells.c.bs_bucket, t.cells.c.t_bucket,
                                        t.cells.c.prefix_bucket, t.cells.c.heads, t.cells.c.n)
                                 .where(t.cells.c.run_id == run_id)).all()
    finally:
        engine.dispose()
    assert {tuple(row[:5]): row[5] for row in cells} == expected


def test_element_counts_beyond_64_bits_saturate_instead_of_wrapping_or_wedging(db_url, make_client):
    """``numel`` (≤ 2^48 a call) is summed per cell and time slot. A batch whose sum passes 2^63 was stored as -2^63;
    a cell whose running sum passes it made PostgreSQL refuse every later batch of that cell (422, for good) and
    SQLite turn the column into a float. The sums stop at 2^63 - 1 instead, exact below it."""
    from shadowd.collector.batch import parse_batch
    from shadowd.collector.rollups import compute_deltas
    from shadowd.judge.policy import Policy
    from shadowd.wire import COUNT_MAX

    top = 2**63 - 1
    one_cell = {"num_layers": 1, "shapes": [(1, 16, 32768, 8)], "packed": True}
    big = parse_batch(make_batch(2**15 + 1, numel=[COUNT_MAX] * (2**15 + 1), **one_cell))
    d = compute_deltas(1, big, Policy(), 60)
    assert d.cells.dicts()[0]["numel"] == top  # (its time slots, each below the top, exact)
    assert sum(r["numel"] for r in d.slots.dicts()) == (2**15 + 1) * COUNT_MAX
    exact = parse_batch(make_batch(40, numel=[COUNT_MAX - 1] * 40, **one_cell))  # 40 · (2^48 - 1) > 2^53
    assert compute_deltas(1, exact, Policy(), 60).cells.dicts()[0]["numel"] == 40 * (COUNT_MAX - 1)

    c = make_client(db_url, ingest_writer="inline")
    run_id = register(c, run_body(num_layers=1))
    assert post_msgpack(c, run_id, make_batch(4, **one_cell)).status_code == 200
    engine = create_engine(db_url)
    try:
        with engine.begin() as conn:
            conn.execute(t.cells.update().values(numel=top - 10))
            conn.execute(t.timeslots.update().values(numel=top - 10))
        r = post_msgpack(c, run_id, make_batch(4, seq=1, **one_cell))
        assert r.status_code == 200, r.text
        with engine.connect() as conn:
            assert conn.execute(select(t.cells.c.numel)).scalars().all() == [top]
            assert set(conn.execute(select(t.timeslots.c.numel)).scalars().all()) == {top}
    finally:
        engine.dispose()
    assert c.get(f"/v1/runs/{run_id}").json()["samples"] == 8


def test_duplicate_batch_is_stored_once_and_conflict_is_409(db_url, make_client):
    c = make_client(db_url)
    run_id = register(c, run_body())
    batch = make_batch(40, seq=7)
    assert post_msgpack(c, run_id, batch).json()["duplicate"] is False
    again = post_msgpack(c, run_id, batch)
    assert again.status_code == 200 and again.json()["duplicate"] is True and again.json()["accepted"] == 0
    # the same batch as JSON is the same content: still a duplicate
    assert c.post(f"/v1/runs/{run_id}/samples", json=batch).json()["duplicate"] is True
    other = make_batch(40, seq=7, rel_l2=5e-3)
    r = post_msgpack(c, run_id, other)
    assert r.status_code == 409 and r.json()["detail"]["field"] == "seq"
    assert count_rows(db_url, t.samples, run_id=run_id) == 40
    assert c.get(f"/v1/runs/{run_id}").json()["duplicate_batches"] == 2


def test_sequence_gaps_are_counted_and_filled(db_url, make_client):
    c = make_client(db_url)
    run_id = register(c, run_body())
    for seq in (0, 1, 4):
        assert post_msgpack(c, run_id, make_batch(8, seq=seq, step0=seq * 10)).status_code == 200
    prods = c.get(f"/v1/runs/{run_id}/producers").json()
    assert prods[0]["gaps"] == 2 and prods[0]["max_seq"] == 4
    post_msgpack(c, run_id, make_batch(8, seq=2, step0=20))
    assert c.get(f"/v1/runs/{run_id}/producers").json()[0]["gaps"] == 1


def test_sequence_gaps_near_the_largest_seq_are_exact(db_url, make_client):
    """seq may be any int64: the gap count never passes through a sum beyond it (PostgreSQL refused the batch as
    "bigint out of range", SQLite turned the count into an inexact float)."""
    c = make_client(db_url)
    run_id = register(c, run_body())
    for i, seq in enumerate((0, 2**62, 2**63 - 1, 5)):  # the last one late, below the largest
        r = post_msgpack(c, run_id, make_batch(8, seq=seq, step0=i * 10))
        assert r.status_code == 200, r.text
    (prod,) = c.get(f"/v1/runs/{run_id}/producers").json()
    assert (prod["max_seq"], prod["gaps"]) == (2**63 - 1, 2**63 - 4)


def test_producer_notes_keep_the_first_reason(db_url, make_client):
    """Why a rank's candidate was disabled or fell back, as its hook said it: on the producer row from the first
    batch that carries it, never overwritten (a process is disabled once), NULL while none was reported."""
    c = make_client(db_url)
    run_id = register(c, run_body())
    assert post_msgpack(c, run_id, make_batch(8, seq=0)).status_code == 200
    assert c.get(f"/v1/runs/{run_id}/producers").json()[0]["disabled_reason"] is None
    first = {**make_batch(8, seq=1, step0=10),
             "producer_notes": {"disabled_reason": "the candidate's error flag: kv_indices entry outside"}}
    assert post_msgpack(c, run_id, first).status_code == 200
    later = {**make_batch(8, seq=2, step0=20),
             "producer_notes": {"disabled_reason": "something else", "fallback_reason": "spot check: nonfinite"}}
    assert post_msgpack(c, run_id, later).status_code == 200
    assert post_msgpack(c, run_id, make_batch(8, seq=3, step0=30)).status_code == 200
    (prod,) = c.get(f"/v1/runs/{run_id}/producers").json()
    assert prod["disabled_reason"] == "the candidate's error flag: kv_indices entry outside"
    assert prod["fallback_reason"] == "spot check: nonfinite"


def test_candidate_errors_are_rolled_up_by_kind_and_named_in_the_verdict(db_url, make_client):
    c = make_client(db_url)
    run_id = register(c, run_body(num_layers=4))
    errs = [None] * 40
    errs[3] = errs[9] = "exception:RuntimeError"
    errs[5] = "candidate_flag:0x1"
    assert post_msgpack(c, run_id, make_batch(40, seq=0, error=errs)).status_code == 200
    errs2 = [None] * 40
    errs2[0] = "candidate_flag:0x1"
    assert post_msgpack(c, run_id, make_batch(40, seq=1, step0=10, ts0=1.7e9 + 100, error=errs2)).status_code == 200
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            rows = {r.error: r for r in conn.execute(select(t.errors).where(t.errors.c.run_id == run_id))}
    finally:
        engine.dispose()
    assert {k: r.n for k, r in rows.items()} == {"exception:RuntimeError": 2, "candidate_flag:0x1": 2}
    assert rows["candidate_flag:0x1"].last_ts > rows["candidate_flag:0x1"].first_ts
    hard = next(x for x in c.get("/readiness", params={"run_id": run_id}).json()["criteria"]
                if x["name"] == "hard_failures")
    assert hard["detail"].endswith(": candidate_flag:0x1 ×2, exception:RuntimeError ×2"), hard["detail"]


def test_exceeding_and_nonfinite_calls_reach_rollups_and_metrics(db_url, make_client):
    c = make_client(db_url)
    run_id = register(c, run_body(num_layers=2))
    n = 20
    cand_nonfinite = [0] * n
    cand_nonfinite[3] = 5  # layer 1, step 1
    rel = [3e-3] * n
    rel[6] = 0.5  # layer 0, step 3: beyond the bf16 tolerance
    batch = make_batch(n, num_layers=2, cand_nonfinite=cand_nonfinite, rel_l2=rel)
    batch["samples"]["rel_l2"] = rel
    assert post_msgpack(c, run_id, batch).status_code == 200
    run = c.get(f"/v1/runs/{run_id}").json()
    assert run["cand_nonfinite"] == 1 and run["exceeded_calls"] == 2
    reg = c.app.state.metrics.registry
    assert reg.get_sample_value("shadowd_samples_total", {"run": str(run_id)}) == n
    assert reg.get_sample_value("shadowd_batches_total", {"run": str(run_id)}) == 1
    assert reg.get_sample_value("shadowd_nonfinite_mismatch_events_total", {"run": str(run_id), "layer": "1"}) == 1
    assert reg.get_sample_value("shadowd_exceeded_calls_total", {"run": str(run_id), "layer": "0"}) == 1
    # rollup-backed histogram: every call of layer 0 counted, the outlier above 2^-2
    labels = {"run": str(run_id), "layer": "0"}
    assert reg.get_sample_value("shadowd_call_rel_l2_count", labels) == n // 2
    assert reg.get_sample_value("shadowd_call_rel_l2_bucket", {**labels, "le": "0.25"}) == n // 2 - 1
    assert reg.get_sample_value("shadowd_layer_samples_total", labels) == n // 2
    engine = create_engine(db_url)
    with engine.connect() as conn:
        exc_steps = conn.execute(select(t.steps.c.step).where((t.steps.c.run_id == run_id)
                                                              & (t.steps.c.exceeded == 1))).scalars().all()
    engine.dispose()
    assert sorted(exc_steps) == [1, 3]


def test_nan_statistics_are_kept_and_counted(db_url, make_client):
    c = make_client(db_url)
    run_id = register(c, run_body(num_layers=1))
    batch = make_batch(4, num_layers=1)
    batch["samples"]["rel_l2"][2] = float("nan")
    r = post_msgpack(c, run_id, batch)
    assert r.status_code == 200, r.text
    layers = c.get(f"/v1/runs/{run_id}/layers").json()["layers"]
    assert layers[0]["nan_stats"] == 1 and layers[0]["exceeded"] == 1
    finite = [v for i, v in enumerate(batch["samples"]["rel_l2"]) if i != 2]
    assert math.isclose(layers[0]["mean_rel_l2"], sum(finite) / 3), "the mean of the finite calls"


def test_a_baseline_event_explains_only_its_own_calls_nan_statistics(db_url, make_client):
    # one call with an infinite rel-L2 and nothing non-finite to explain it, one baseline event (finite statistics)
    # in the same cell: the cell keeps one unexplained call (the judge's tolerance failure), not 1 - 1 = 0
    c = make_client(db_url)
    run_id = register(c, run_body(num_layers=1))
    batch = make_batch(4, num_layers=1, shapes=[(1, 16, 32768, 8)])
    batch["samples"]["rel_l2"][1] = float("inf")
    batch["samples"]["base_nonfinite"][2] = 3
    batch["samples"]["nan_base"][2] = 3
    assert post_msgpack(c, run_id, batch).status_code == 200
    engine = create_engine(db_url)
    with engine.connect() as conn:
        (cell,) = conn.execute(select(t.cells).where(t.cells.c.run_id == run_id)).mappings().all()
        slots = conn.execute(select(t.timeslots.c.n_nan_unexplained).where(t.timeslots.c.run_id == run_id)).all()
    engine.dispose()
    assert (cell["n_nan_stat"], cell["n_base_nonfinite"], cell["n_nan_unexplained"]) == (1, 1, 1)
    assert sum(r[0] for r in slots) == 1


def test_a_layer_whose_every_statistic_is_infinite_has_no_mean(db_url, make_client):
    # (an empty sum over n calls read as a mean of 0: a perfect layer in the summary beside a failing verdict)
    c = make_client(db_url)
    run_id = register(c, run_body(num_layers=1))
    batch = make_batch(3, num_layers=1)
    batch["samples"]["rel_l2"] = [float("inf")] * 3
    assert post_msgpack(c, run_id, batch).status_code == 200
    (layer,) = c.get(f"/v1/runs/{run_id}/layers").json()["layers"]
    assert layer["nan_stats"] == 3 and layer["mean_rel_l2"] is None and layer["mean_max_abs"] is None


def test_kill_switch_reaches_ingest_answers(db_url, make_client):
    c = make_client(db_url)
    run_id = register(c, run_body())
    assert c.put(f"/v1/runs/{run_id}/mode", json={"mode": "validate"}).json()["mode_override"] == "validate"
    assert post_msgpack(c, run_id, make_batch(4)).json()["mode_override"] == "validate"
    assert c.put(f"/v1/runs/{run_id}/mode", json={"mode": None}).json()["mode_override"] is None
    bad = c.put(f"/v1/runs/{run_id}/mode", json={"mode": "on"})
    assert bad.status_code == 422 and bad.json()["detail"]["field"] == "mode"


def test_packed_histograms_equal_list_histograms(fresh_sqlite, make_client):
    c = make_client(fresh_sqlite)
    run_id = register(c, run_body(num_layers=4))
    assert post_msgpack(c, run_id, make_batch(40, seq=0, packed_hist=True)).status_code == 200
    # the same samples as lists from another producer give identical rollups
    assert post_msgpack(c, run_id, make_batch(40, seq=0, producer="p2")).status_code == 200
    rows = sample_rows(fresh_sqlite)
    assert [r["hist"] for r in rows if r["producer"] == "p-test"] == [r["hist"] for r in rows if r["producer"] == "p2"]
    assert rows[0]["hist"] == make_batch(40)["samples"]["hist"][0]
    bad = make_batch(40, seq=1, packed_hist=True)
    bad["samples"]["hist"] = bad["samples"]["hist"][:-8]
    r = post_msgpack(c, run_id, bad)
    assert r.status_code == 422 and r.json()["detail"]["field"] == "samples.hist"


def test_packed_and_list_columns_store_identical_rows(db_url, make_client):
    """Every numeric column packed (what the hook sends), as lists, or as JSON: the same rows, rollups and
    digest — re-sending the batch in another form is a duplicate."""
    c = make_client(db_url)
    run_id = register(c, run_body(num_layers=4))
    n = 60
    rel = [3e-3] * n
    rel[5], rel[7] = float("nan"), 0.5
    extra = {"rel_l2": rel, "cand_us": [None, 12.5] * (n // 2), "error": [None] * (n - 1) + ["exception:X"],
             "nan_cand": [0] * (n - 1) + [3], "mode": "validate"}
    listed = make_batch(n, seq=0, producer="lists", **extra)
    packed = make_batch(n, seq=0, producer="packed", packed=True, **extra)
    assert isinstance(packed["samples"]["ts"], bytes) and isinstance(packed["samples"]["hist"], bytes)
    assert post_msgpack(c, run_id, listed).status_code == 200
    assert post_msgpack(c, run_id, packed).status_code == 200
    rows = sample_rows(db_url)
    by = {p: [{k: v for k, v in r.items() if k not in ("id", "batch_id", "producer")} for r in rows
              if r["producer"] == p] for p in ("lists", "packed")}
    assert len(by["lists"]) == n and by["lists"] == by["packed"]
    first = by["lists"][0]
    # a missing optional value: NULL (SQLite stores NaN as NULL; PostgreSQL keeps NaN)
    assert first["mode"] == "validate" and first["cand_us"] in (None, "NaN") and first["exceeded"] == 0
    assert by["lists"][1]["cand_us"] == 12.5 and by["lists"][-1]["nan_cand"] == 3
    assert by["lists"][-1]["error"] == "exception:X" and by["lists"][7]["exceeded"] == 1
    assert first["rel_l2"] == listed["samples"]["rel_l2"][0] and first["hist"] == listed["samples"]["hist"][0]
    # the packed batch re-sent as lists or JSON is the same content: a duplicate, not a conflict
    relisted = {**listed, "producer": "packed"}
    assert post_msgpack(c, run_id, relisted).json()["duplicate"] is True
    as_json = orjson.dumps(relisted)  # NaN travels as null
    r = c.post(f"/v1/runs/{run_id}/samples", content=as_json, headers={"content-type": "application/json"})
    assert r.json()["duplicate"] is True
    changed = make_batch(n, seq=0, producer="packed", packed=True, **{**extra, "mode": "on"})
    assert post_msgpack(c, run_id, changed).status_code == 409
    layers = c.get(f"/v1/runs/{run_id}/layers").json()["layers"]
    assert sum(x["samples"] for x in layers) == 2 * n and sum(x["exceeded"] for x in layers) == 2 * 3


def test_packed_columns_are_validated(fresh_sqlite, make_client):
    c = make_client(fresh_sqlite)
    run_id = register(c, run_body(num_layers=4))
    short = make_batch(6, packed=True)
    short["samples"]["ts"] = short["samples"]["ts"][:-8]
    negative = make_batch(6, packed=True, nan_base=[0, 0, -1, 0, 0, 0])
    nan_ts = make_batch(6, packed=True, ts=[1.7e9, float("nan"), 1.7e9, 1.7e9, 1.7e9, 1.7e9])
    huge = make_batch(6, packed=True, heads=[8, 8, 8, 2**31, 8, 8])
    packed_str = make_batch(6, packed=True)
    packed_str["samples"]["mode"] = b"validate"
    for batch, field in ((short, "samples.ts"), (negative, "samples.nan_base[2]"), (nan_ts, "samples.ts[1]"),
                         (huge, "samples.heads[3]"), (packed_str, "samples.mode")):
        r = post_msgpack(c, run_id, batch)
        assert r.status_code == 422 and r.json()["detail"]["field"] == field, r.text
    assert count_rows(fresh_sqlite, t.samples) == 0


def test_speculative_accept_length_per_mode(db_url, make_client):
    """Producers report SGLang's cumulative spec counters; the run shows accept length per mode."""
    c = make_client(db_url)
    run_id = register(c, run_body(num_layers=4, tp_size=2))
    validate = {"spec_accept_tokens_validate": 300, "spec_req_steps_validate": 100, "spec_passes_validate": 25}
    on = {"spec_accept_tokens_on": 150, "spec_req_steps_on": 60, "spec_passes_on": 15}
    b0 = make_batch(8, seq=0)
    b0["producer_stats"] = validate
    b1 = make_batch(8, seq=2, step0=20)
    b1["producer_stats"] = {**validate, **on}
    # rank 1 sees the same batches: it must not be counted twice
    r1 = make_batch(8, seq=0, producer="rank1", rank=1)
    r1["producer_stats"] = {**validate, **on}
    for b in (b0, b1, r1):
        assert post_msgpack(c, run_id, b).status_code == 200
    # a late batch (seq 1 after seq 2, from the spool) does not move cumulative counters back
    late = make_batch(8, seq=1, step0=10)
    late["producer_stats"] = {"spec_accept_tokens_validate": 1, "spec_req_steps_validate": 1,
                              "spec_passes_validate": 1}
    assert post_msgpack(c, run_id, late).json()["duplicate"] is False
    spec = c.get(f"/v1/runs/{run_id}").json()["speculative"]
    assert spec["validate"]["accept_length"] == 3.0 and spec["validate"]["verify_passes"] == 25
    assert spec["on"]["accept_length"] == 2.5 and spec["on"]["tokens_per_step"] == 10.0
    assert "off" not in spec
    assert c.get("/readiness", params={"run_id": run_id}).json()["speculative"] == spec
    reg = c.app.state.metrics.registry
    assert reg.get_sample_value("shadowd_spec_accept_length", {"run": str(run_id), "mode": "on"}) == 2.5
    assert reg.get_sample_value("shadowd_spec_verify_passes_total", {"run": str(run_id), "mode": "validate"}) == 25


def test_speculative_counters_of_pipeline_stages_are_not_added_up(db_url, make_client):
    """Under --pp-size each stage's scheduler may count the same verify steps under TP rank 0: one stage is
    counted (the one with the most passes), never their sum, and a stage that counts nothing changes nothing."""
    c = make_client(db_url)
    run_id = register(c, run_body(num_layers=4, tp_size=1))
    counts = {"spec_accept_tokens_validate": 300, "spec_req_steps_validate": 100, "spec_passes_validate": 25}
    for stage, producer, stats in ((0, "s0", {}), (1, "s1", counts), (2, "s2", counts)):
        b = {**make_batch(8, producer=producer), "producer_stats": stats or {"dropped": 0}}
        if stage:
            b["stage"] = stage
        assert post_msgpack(c, run_id, b).status_code == 200
    spec = c.get(f"/v1/runs/{run_id}").json()["speculative"]
    assert spec["validate"]["verify_passes"] == 25 and spec["validate"]["request_steps"] == 100
    assert spec["validate"]["accept_length"] == 3.0


def test_calls_that_compared_nothing_are_stored_but_are_no_evidence(db_url, make_client):
    """numel is the output elements compared: a call with none and no error (every baseline value NaN, say) is
    stored, but counts toward no coverage, tolerance, exceedance, steps, requests or sample times."""
    c = make_client(db_url)
    run_id = register(c, run_body(num_layers=2))
    n = 40  # 20 steps of 2 layers; steps 10..19 compared nothing, with statistics that would exceed
    empty = [i >= 20 for i in range(n)]
    batch = make_batch(n, num_layers=2, ts0=1.7e9, numel=[0 if e else 4096 for e in empty],
                       rel_l2=[0.5 if e else 3e-3 for e in empty], base_nonfinite=[4096 if e else 0 for e in empty])
    assert post_msgpack(c, run_id, batch).status_code == 200
    # a batch in which nothing was compared at all, much later: stored, and no sample time moves
    late = make_batch(8, num_layers=2, seq=1, step0=100, ts0=1.7e9 + 3600, numel=0, rel_l2=float("nan"))
    assert post_msgpack(c, run_id, late).status_code == 200
    assert count_rows(db_url, t.samples, run_id=run_id) == n + 8

    run = c.get(f"/v1/runs/{run_id}").json()
    assert run["samples"] == n + 8 and run["exceeded_calls"] == 0
    assert run["first_sample_ts"] == 1.7e9 and run["last_sample_ts"] == 1.7e9 + 9 * 0.05
    assert run["requests"] == sum(batch["samples"]["new_requests"][:20])
    layers = c.get(f"/v1/runs/{run_id}/layers").json()["layers"]
    assert [row["samples"] for row in layers] == [10, 10] and max(row["max_rel_l2"] for row in layers) < 0.01
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            steps = conn.execute(select(t.steps.c.step).where(t.steps.c.run_id == run_id)).scalars().all()
            ranks = conn.execute(select(t.ranks.c.layer, t.ranks.c.n, t.ranks.c.n_empty)
                                 .where(t.ranks.c.run_id == run_id).order_by(t.ranks.c.layer)).all()
            slots = conn.execute(select(t.timeslots.c.t).where(t.timeslots.c.run_id == run_id)).scalars().all()
    finally:
        engine.dispose()
    assert sorted(steps) == list(range(10))
    assert [tuple(r) for r in ranks] == [(0, 10, 14), (1, 10, 14)]
    assert max(slots) < 1.7e9 + 3600
    report = c.get("/readiness", params={"run_id": run_id}).json()
    ex = next(x for x in report["criteria"] if x["name"] == "exceedance")
    assert ex["observed"]["steps"] == 10 and ex["observed"]["exceeding_steps"] == 0
    assert next(x for x in report["criteria"] if x["name"] == "tolerance")["status"] == "pass"
