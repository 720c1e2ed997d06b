"""/metrics series read from the database: producer health per rank and the last ingest time."""

from __future__ import annotations

import time

from tests.collector.helpers import post_msgpack, register
from tests.factories import make_batch, run_body


def _at(run_id: int, rank: int, stage: int = 0) -> dict[str, str]:
    """The labels of a producer gauge."""
    return {"run": str(run_id), "stage": str(stage), "rank": str(rank)}


def test_producer_gauges_follow_each_ranks_latest_producer(db_url, make_client):
    """A rank whose process disabled the candidate and was restarted is not 'disabled' in /metrics any more
    (the ShadowdCandidateDisabled alert clears), and its old drops are not added to the new process's."""
    c = make_client(db_url)
    run_id = register(c, run_body(num_layers=4, tp_size=2))
    old = {**make_batch(8, rank=1, producer="r1-old"), "producer_stats": {"disabled": 1, "dropped": 7}}
    assert post_msgpack(c, run_id, old).status_code == 200
    assert post_msgpack(c, run_id, make_batch(8, rank=0, producer="r0")).status_code == 200
    reg = c.app.state.metrics.registry
    rank1 = _at(run_id, 1)
    assert reg.get_sample_value("shadowd_producer_candidate_disabled", rank1) == 1.0
    time.sleep(0.01)  # the restarted process is first seen later
    new = {**make_batch(8, rank=1, producer="r1-new", step0=10), "producer_stats": {"dropped": 2}}
    assert post_msgpack(c, run_id, new).status_code == 200
    assert reg.get_sample_value("shadowd_producer_candidate_disabled", rank1) == 0.0
    assert reg.get_sample_value("shadowd_producer_dropped_samples", rank1) == 2.0
    assert reg.get_sample_value("shadowd_producer_candidate_disabled", _at(run_id, 0)) == 0.0


def test_on_mode_shape_counters_per_rank(db_url, make_client):
    """How much of on mode's traffic the verdict covers: each rank's latest counts of calls on a covered shape and
    on an uncovered one (which the baseline served); a late re-delivered batch cannot move them back."""
    c = make_client(db_url)
    run_id = register(c, run_body(num_layers=4, tp_size=2))
    for rank, cov, unc in ((0, 900, 100), (1, 400, 0)):
        body = {**make_batch(8, rank=rank, producer=f"r{rank}"),
                "producer_stats": {"on_covered_calls": cov, "on_uncovered_calls": unc}}
        assert post_msgpack(c, run_id, body).status_code == 200
    reg = c.app.state.metrics.registry
    assert reg.get_sample_value("shadowd_producer_on_covered_calls", _at(run_id, 0)) == 900.0
    assert reg.get_sample_value("shadowd_producer_on_uncovered_calls", _at(run_id, 0)) == 100.0
    assert reg.get_sample_value("shadowd_producer_on_uncovered_calls", _at(run_id, 1)) == 0.0
    newer = {**make_batch(8, rank=0, producer="r0", seq=2, step0=20),
             "producer_stats": {"on_covered_calls": 950, "on_uncovered_calls": 120}}
    late = {**make_batch(8, rank=0, producer="r0", seq=1, step0=10),  # delivered after seq 2 (spooled)
            "producer_stats": {"on_covered_calls": 920, "on_uncovered_calls": 110}}
    assert post_msgpack(c, run_id, newer).status_code == 200
    assert post_msgpack(c, run_id, late).status_code == 200
    assert reg.get_sample_value("shadowd_producer_on_covered_calls", _at(run_id, 0)) == 950.0
    assert reg.get_sample_value("shadowd_producer_on_uncovered_calls", _at(run_id, 0)) == 120.0
    # the run's totals over its processes
    assert c.get(f"/v1/runs/{run_id}").json()["on_mode_shapes"] == {"covered_calls": 1350, "uncovered_calls": 120}
    assert c.get(f"/v1/runs/{register(c, run_body(run_key='quiet'))}").json()["on_mode_shapes"] == {}


def test_last_ingest_time_survives_a_collector_restart(fresh_sqlite, make_client):
    """ShadowdIngestStalled needs the time of the run's last batch from a collector that has not stored one
    since it started: the gauge is read from the database."""
    c = make_client(fresh_sqlite)
    run_id = register(c, run_body())
    before = time.time()
    assert post_msgpack(c, run_id, make_batch(8)).status_code == 200
    labels = {"run": str(run_id)}
    first = c.app.state.metrics.registry.get_sample_value("shadowd_last_ingest_timestamp_seconds", labels)
    assert first is not None and before <= first <= time.time()
    restarted = make_client(fresh_sqlite)  # a new process: no ingest of its own
    assert restarted.app.state.metrics.registry.get_sample_value("shadowd_last_ingest_timestamp_seconds",
                                                                 labels) == first


def test_event_counters_exist_at_zero_before_the_first_event(fresh_sqlite, make_client):
    """increase() and rate() read nothing from a counter series born with its first event (a series needs two
    samples to increase between): the dashboard's non-finite and exceedance panels and the tolerance alert would
    miss a layer's first non-finite call or exceedance. Every layer a batch reaches has both series, at 0."""
    c = make_client(fresh_sqlite)
    run_id = register(c, run_body(num_layers=4))
    assert post_msgpack(c, run_id, make_batch(16, num_layers=4)).status_code == 200
    reg = c.app.state.metrics.registry
    for layer in range(4):
        labels = {"run": str(run_id), "layer": str(layer)}
        assert reg.get_sample_value("shadowd_nonfinite_mismatch_events_total", labels) == 0.0, layer
        assert reg.get_sample_value("shadowd_exceeded_calls_total", labels) == 0.0, layer
    bad = make_batch(16, num_layers=4, seq=1, step0=4, cand_nonfinite=[0, 0, 2] + [0] * 13)
    assert post_msgpack(c, run_id, bad).status_code == 200
    labels = {"run": str(run_id), "layer": "2"}
    assert reg.get_sample_value("shadowd_nonfinite_mismatch_events_total", labels) == 1.0
    assert reg.get_sample_value("shadowd_exceeded_calls_total", labels) == 1.0
    assert reg.get_sample_value("shadowd_nonfinite_mismatch_events_total", {**labels, "layer": "3"}) == 0.0


def test_a_runs_event_counters_exist_at_zero_from_its_registration_and_after_a_restart(fresh_sqlite, make_client):
    """Made at 0 before the run's first batch, so even a first batch holding the layer's first event shows in
    increase() — at registration, and again in a restarted collector for the runs still active."""
    c = make_client(fresh_sqlite)
    run_id = register(c, run_body(num_layers=3))
    reg = c.app.state.metrics.registry
    for layer in range(3):
        labels = {"run": str(run_id), "layer": str(layer)}
        assert reg.get_sample_value("shadowd_exceeded_calls_total", labels) == 0.0, layer
        assert reg.get_sample_value("shadowd_nonfinite_mismatch_events_total", labels) == 0.0, layer
    assert reg.get_sample_value("shadowd_exceeded_calls_total", {"run": str(run_id), "layer": "3"}) is None
    assert reg.get_sample_value("shadowd_samples_total", {"run": str(run_id)}) == 0.0
    assert post_msgpack(c, run_id, make_batch(8, num_layers=3)).status_code == 200
    idle = register(c, run_body("never-sent", num_layers=2))
    restarted = make_client(fresh_sqlite)  # its lifespan ran: the active run is declared, the idle one not
    reg2 = restarted.app.state.metrics.registry
    assert reg2.get_sample_value("shadowd_exceeded_calls_total", {"run": str(run_id), "layer": "2"}) == 0.0
    assert reg2.get_sample_value("shadowd_exceeded_calls_total", {"run": str(idle), "layer": "0"}) is None


def test_a_huge_declared_layer_count_makes_a_bounded_number_of_series(fresh_sqlite, make_client):
    from shadowd.collector.metrics import DECLARE_LAYERS_MAX

    c = make_client(fresh_sqlite)
    run_id = register(c, run_body(num_layers=100_000))
    reg = c.app.state.metrics.registry
    last = {"run": str(run_id), "layer": str(DECLARE_LAYERS_MAX - 1)}
    assert reg.get_sample_value("shadowd_exceeded_calls_total", last) == 0.0
    assert reg.get_sample_value("shadowd_exceeded_calls_total", {**last, "layer": str(DECLARE_LAYERS_MAX)}) is None


def _stats_only(producer: str, seq: int, **stats: int) -> dict[str, object]:
    return {"producer": producer, "seq": seq, "samples": {}, "producer_stats": stats}


def test_a_stats_only_batch_reports_drops_after_traffic_stopped(db_url, make_client):
    """A producer whose spool overflowed during an outage reports its drop count with its next batch; when
    traffic has stopped by the time the collector is back, there is no next batch of samples. The streamer
    then sends its figures alone: the collector stores them (drops in /metrics, the producer's sequence
    without a gap) and adds nothing to the run's samples or rollups."""
    c = make_client(db_url)
    run_id = register(c, run_body(num_layers=4, tp_size=2))
    first = {**make_batch(8, rank=1, producer="p"), "producer_stats": {"dropped": 3}}
    assert post_msgpack(c, run_id, first).status_code == 200
    before = c.get(f"/v1/runs/{run_id}").json()
    r = post_msgpack(c, run_id, _stats_only("p", 1, dropped=40, spool_depth=0))
    assert r.status_code == 200, r.text
    reg = c.app.state.metrics.registry
    assert reg.get_sample_value("shadowd_producer_dropped_samples", _at(run_id, 1)) == 40.0
    assert reg.get_sample_value("shadowd_producer_sequence_gaps", _at(run_id, 1)) == 0.0
    after = c.get(f"/v1/runs/{run_id}").json()
    assert after["samples"] == before["samples"] == 8
    assert (after["batches"], after["last_ingest_at"]) == (2, before["last_ingest_at"])
    # replayed (the answer was lost): a duplicate, nothing changes
    r = post_msgpack(c, run_id, _stats_only("p", 1, dropped=40, spool_depth=0))
    assert r.status_code == 200 and r.json()["duplicate"] is True
    assert reg.get_sample_value("shadowd_producer_dropped_samples", _at(run_id, 1)) == 40.0
    assert c.get(f"/v1/runs/{run_id}").json()["duplicate_batches"] == 1


def test_a_stats_only_batch_needs_figures_and_a_known_producer(db_url, make_client):
    """An empty batch without figures is refused as before; figures from a producer the run has never heard
    of name no rank to report them under, so they are refused (422, naming the producer) and nothing is
    stored — the producer's later batch of samples with that seq is still taken."""
    c = make_client(db_url)
    run_id = register(c, run_body(num_layers=4, tp_size=2))
    r = post_msgpack(c, run_id, {"producer": "p", "seq": 0, "samples": {}})
    assert r.status_code == 422 and "samples" in r.text
    r = post_msgpack(c, run_id, _stats_only("stranger", 0, dropped=5))
    assert r.status_code == 422 and "producer" in r.text, r.text
    assert post_msgpack(c, run_id, make_batch(8, rank=1, producer="stranger")).status_code == 200
    reg = c.app.state.metrics.registry
    assert reg.get_sample_value("shadowd_producer_sequence_gaps", _at(run_id, 1)) == 0.0


def test_a_stats_only_batch_of_a_producer_whose_samples_all_dropped_is_filed_under_its_stated_rank(db_url,
                                                                                                   make_client):
    """A producer whose every batch was dropped (its spool bound hit during an outage) has no stored sample to
    take a rank from; its stats-only batch states the rank, and its drops show under it. A stated rank the run
    cannot have is refused, naming ``rank``, and stores nothing (the seq stays free for the real batch); a later
    figure of the same producer is filed under the rank first stored."""
    c = make_client(db_url)
    run_id = register(c, run_body(num_layers=4, tp_size=2))
    reg = c.app.state.metrics.registry
    for bad in (2, -1, "1", True):
        r = post_msgpack(c, run_id, {**_stats_only("lost", 0, dropped=50), "rank": bad})
        assert r.status_code == 422 and r.json()["detail"]["field"] == "rank", (bad, r.text)
    assert c.get(f"/v1/runs/{run_id}").json()["batches"] == 0
    assert reg.get_sample_value("shadowd_producer_dropped_samples", _at(run_id, 1)) in (None, 0.0)
    r = post_msgpack(c, run_id, {**_stats_only("lost", 0, dropped=50), "rank": 1})
    assert r.status_code == 200, r.text
    assert reg.get_sample_value("shadowd_producer_dropped_samples", _at(run_id, 1)) == 50.0
    r = post_msgpack(c, run_id, _stats_only("lost", 1, dropped=60))  # no rank now: the stored one is used
    assert r.status_code == 200, r.text
    assert reg.get_sample_value("shadowd_producer_dropped_samples", _at(run_id, 1)) == 60.0
    assert c.get(f"/v1/runs/{run_id}").json()["samples"] == 0


def test_a_producers_clock_offset_is_exported_per_rank(db_url, make_client):
    """A producer whose clock is behind stamps its samples in the past, which a spooled batch's samples
    legitimately are too; the send stamp of each attempt tells them apart. /metrics exports the offset per rank
    (the ShadowdProducerClockSkew alert reads it); a malformed stamp is refused, naming the header, and nothing of
    the batch is stored."""
    c = make_client(db_url)
    run_id = register(c, run_body(num_layers=4, tp_size=2))
    behind = {"X-Shadowd-Sent-At": f"{time.time() - 120:.3f}"}
    assert post_msgpack(c, run_id, make_batch(8, rank=1, producer="p"), **behind).status_code == 200
    offset = c.app.state.metrics.registry.get_sample_value("shadowd_producer_clock_offset_seconds",
                                                           _at(run_id, 1))
    assert offset is not None and 119 < offset < 130
    for bad in ("yesterday", "nan", "-5", "1e300"):
        r = post_msgpack(c, run_id, make_batch(8, rank=0, producer="q"), **{"X-Shadowd-Sent-At": bad})
        assert r.status_code == 400 and r.json()["detail"]["field"] == "X-Shadowd-Sent-At", (bad, r.text)
    assert c.get(f"/v1/runs/{run_id}").json()["samples"] == 8
    assert c.app.state.metrics.registry.get_sample_value("shadowd_producer_clock_offset_seconds",
                                                         _at(run_id, 0)) is None


def test_pipeline_stages_sharing_a_rank_keep_their_producer_figures_apart(db_url, make_client):
    """--pp-size 2: stage 0 runs layers 0-1 and stage 1 layers 2-3, both with TP rank 0, both live. Stage 0's
    process disabled its candidate and dropped samples, then stage 1's started: filed under the rank alone, the
    later producer's figures hid the earlier's (the gauges said 'healthy', the ShadowdCandidateDisabled alert
    stayed quiet). Each (stage, rank) now has its own series; the producer rows and readiness notes name the
    stage; the clock offset is kept per stage too."""
    c = make_client(db_url)
    run_id = register(c, run_body(num_layers=4, tp_size=1))
    stage0 = {**make_batch(8, producer="s0", layer=[0, 1] * 4),
              "producer_stats": {"disabled": 1, "dropped": 7},
              "producer_notes": {"disabled_reason": "candidate raised 5 times in a row"}}
    assert post_msgpack(c, run_id, stage0).status_code == 200
    time.sleep(0.01)  # stage 1's process is first seen later
    stage1 = {**make_batch(8, producer="s1", layer=[2, 3] * 4), "stage": 1}
    behind = {"X-Shadowd-Sent-At": f"{time.time() - 120:.3f}"}
    assert post_msgpack(c, run_id, stage1, **behind).status_code == 200
    reg = c.app.state.metrics.registry
    s0, s1 = _at(run_id, 0, stage=0), _at(run_id, 0, stage=1)
    assert reg.get_sample_value("shadowd_producer_candidate_disabled", s0) == 1.0
    assert reg.get_sample_value("shadowd_producer_dropped_samples", s0) == 7.0
    assert reg.get_sample_value("shadowd_producer_candidate_disabled", s1) == 0.0
    assert reg.get_sample_value("shadowd_producer_dropped_samples", s1) == 0.0
    assert 119 < (reg.get_sample_value("shadowd_producer_clock_offset_seconds", s1) or 0) < 130
    assert reg.get_sample_value("shadowd_producer_clock_offset_seconds", s0) is None  # (stage 0 sent no stamp)
    rows = c.get(f"/v1/runs/{run_id}/producers").json()
    assert [(p["producer"], p["stage"], p["rank"]) for p in rows] == [("s0", 0, 0), ("s1", 1, 0)]
    ready = c.get("/readiness", params={"run_id": run_id}).json()
    assert [(n["stage"], n["rank"], n["producer"]) for n in ready["producer_notes"]] == [(0, 0, "s0")]
    # a stage restarts: its new producer replaces only that stage's figures
    time.sleep(0.01)
    again = {**make_batch(8, producer="s0-new", layer=[0, 1] * 4, step0=10), "producer_stats": {"dropped": 1}}
    assert post_msgpack(c, run_id, again).status_code == 200
    assert reg.get_sample_value("shadowd_producer_candidate_disabled", s0) == 0.0
    assert reg.get_sample_value("shadowd_producer_dropped_samples", s0) == 1.0
    assert reg.get_sample_value("shadowd_producer_dropped_samples", s1) == 0.0


def test_a_batch_stating_a_bad_stage_is_refused_naming_it(db_url, make_client):
    c = make_client(db_url)
    run_id = register(c, run_body(num_layers=4, tp_size=1))
    for bad in (-1, True, "1", 1.5, 2**31):
        r = post_msgpack(c, run_id, {**make_batch(4, producer="p"), "stage": bad})
        assert r.status_code == 422 and r.json()["detail"]["field"] == "stage", (bad, r.text)
    assert c.get(f"/v1/runs/{run_id}").json()["samples"] == 0
    assert c.get(f"/v1/runs/{run_id}/producers").json() == []
