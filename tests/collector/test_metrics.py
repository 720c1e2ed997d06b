"""/metrics series read from the database: producer health per rank and the last ingest time."""

from __future__ import annotations

import time

from tests.collector.helpers import post_msgpack, register
from tests.factories import make_batch, run_body


def test_producer_gauges_follow_each_ranks_latest_producer(db_url, make_client):
    """A rank whose process disabled the candidate and was restarted is not 'disabled' in /metrics any more
    (the ShadowdCandidateDisabled alert clears), and its old drops are not added to the new process's."""
    c = make_client(db_url)
    run_id = register(c, run_body(num_layers=4, tp_size=2))
    old = {**make_batch(8, rank=1, producer="r1-old"), "producer_stats": {"disabled": 1, "dropped": 7}}
    assert post_msgpack(c, run_id, old).status_code == 200
    assert post_msgpack(c, run_id, make_batch(8, rank=0, producer="r0")).status_code == 200
    reg = c.app.state.metrics.registry
    rank1 = {"run": str(run_id), "rank": "1"}
    assert reg.get_sample_value("shadowd_producer_candidate_disabled", rank1) == 1.0
    time.sleep(0.01)  # the restarted process is first seen later
    new = {**make_batch(8, rank=1, producer="r1-new", step0=10), "producer_stats": {"dropped": 2}}
    assert post_msgpack(c, run_id, new).status_code == 200
    assert reg.get_sample_value("shadowd_producer_candidate_disabled", rank1) == 0.0
    assert reg.get_sample_value("shadowd_producer_dropped_samples", rank1) == 2.0
    assert reg.get_sample_value("shadowd_producer_candidate_disabled", {"run": str(run_id), "rank": "0"}) == 0.0


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
