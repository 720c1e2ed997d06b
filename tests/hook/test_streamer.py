"""The streamer against a real collector: batches, spool and replay, never-blocking enqueue, kill switch."""

from __future__ import annotations

import socket
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from shadowd.cli import main
from shadowd.client import BatchRejected, CollectorClient, CollectorUnavailable
from shadowd.collector.batch import parse_batch
from shadowd.hook.site import ShadowSite
from shadowd.hook.spool import Spool, spool_dir
from shadowd.hook.streamer import Streamer, build_batch
from shadowd.wire import HIST_BINS, decode_msgpack, encode_msgpack
from tests.hook.conftest import Collector, base_fn, cand_fn, free_port, inputs, make_runtime, run_body, wait_for


def sample(i: int, layer: int = 0) -> dict[str, Any]:
    return {"layer": layer, "rank": 0, "step": i, "call": i, "ts": time.time(), "batch_size": 1, "draft_tokens": 8,
            "prefix_len": 100, "heads": 8, "numel": 4096, "max_abs": 1e-3, "mean_abs": 1e-4, "max_rel": 1e-2,
            "rel_l2": 2e-3, "cos_diff": 2e-6, "out_scale": 1.0, "nan_base": 0, "inf_base": 0, "nan_cand": 0,
            "inf_cand": 0, "cand_nonfinite": 0, "base_nonfinite": 0, "hist": [0] * (HIST_BINS - 1) + [4096],
            "error": None, "mode": "validate", "cand_us": 10.0, "base_us": 20.0}


def test_batches_are_valid_wire_batches() -> None:
    rt, sink = make_runtime("validate")
    site = ShadowSite("s", base_fn, cand_fn, runtime=rt)
    x, w = inputs()
    for layer in range(3):
        site(x, w, layer=layer)
    site_err = ShadowSite("s", base_fn, lambda *a: 1 / 0, runtime=rt)
    site_err(x, w, layer=0)
    batch = build_batch("p1", 0, list(sink), {"dropped": 0, "spool_depth": 0, "fallback": 0})
    vb = parse_batch(batch)
    assert vb.n == 4 and vb.cols["error"][-1] == "exception:ZeroDivisionError"
    # numeric columns travel packed; as lists they are the same content
    assert isinstance(batch["samples"]["max_abs"], bytes) and isinstance(batch["samples"]["hist"], bytes)
    assert isinstance(batch["samples"]["error"], list)
    listed = parse_batch(build_batch("p1", 0, list(sink), packed=False))
    assert isinstance(build_batch("p1", 0, list(sink), packed=False)["samples"]["max_abs"], list)
    assert listed.digest == vb.digest
    for name, col in vb.cols.items():
        a, b = col, listed.cols[name]
        assert (a == b if isinstance(a, list) else np.array_equal(a, b, equal_nan=True)), name


def test_producer_notes_travel_trimmed_and_only_when_there_is_one() -> None:
    samples = [sample(0)]
    assert "producer_notes" not in build_batch("p", 0, samples, producer_notes={"disabled_reason": ""})
    b = build_batch("p", 0, samples, producer_notes={"disabled_reason": "x" * 500, "fallback_reason": "spot check"})
    vb = parse_batch(decode_msgpack(encode_msgpack(b)))
    assert vb.producer_notes == {"disabled_reason": "x" * 300, "fallback_reason": "spot check"}


def test_a_pipeline_stages_batches_state_the_stage_and_stage_0s_are_as_before() -> None:
    samples = [sample(0)]
    assert "stage" not in build_batch("p", 0, samples)
    assert "stage" not in build_batch("p", 1, [], {"dropped": 3}, rank=0)
    for batch in (build_batch("p", 0, samples, stage=2), build_batch("p", 1, [], {"dropped": 3}, rank=0, stage=2)):
        assert parse_batch(decode_msgpack(encode_msgpack(batch))).stage == 2
    assert parse_batch(decode_msgpack(encode_msgpack(build_batch("p", 0, samples)))).stage == 0


def test_the_stages_sharing_a_rank_spool_apart_and_stage_0_keeps_its_directory(tmp_path: Path) -> None:
    # stage 0's directory is the one an earlier version spooled into (a restart after the upgrade replays it)
    assert spool_dir(tmp_path, "launch", 3) == spool_dir(tmp_path, "launch", 3, stage=0) == (
        tmp_path / spool_dir(tmp_path, "launch", 3).parent.name / "rank3")
    dirs = {spool_dir(tmp_path, "launch", r, stage=s) for s in (0, 1, 2) for r in (0, 1)}
    assert len(dirs) == 6 and len({d.parent for d in dirs}) == 1, "one run key, a directory per (stage, rank)"


def test_packed_batch_keeps_missing_values_and_non_finite_statistics() -> None:
    samples = [sample(i) for i in range(3)]
    samples[1]["cand_us"] = None
    samples[2]["rel_l2"] = float("nan")
    samples[2]["max_abs"] = float("inf")
    samples[0]["new_requests"] = 2
    vb = parse_batch(decode_msgpack(encode_msgpack(build_batch("p", 0, samples))))
    assert vb.cols["cand_us"][0] == 10.0 and np.isnan(vb.cols["cand_us"][1])
    assert np.isnan(vb.cols["rel_l2"][2]) and np.isinf(vb.cols["max_abs"][2])
    assert vb.cols["new_requests"].tolist() == [2, 0, 0]
    assert vb.cols["hist"][0].tolist() == samples[0]["hist"]


def test_client_errors_are_typed(collector: Collector) -> None:
    c = CollectorClient(collector.url)
    run = c.register_run(run_body("typed"))
    assert c.register_run(run_body("typed"))["id"] == run["id"]
    with pytest.raises(BatchRejected) as e:
        c.post_batch(run["id"], b"\x93garbage")
    assert 400 <= e.value.status < 500
    with pytest.raises(BatchRejected) as e:
        c.get_run(99999)
    assert e.value.status == 404
    status, body = c.readiness(run["id"])
    assert status == 503 and body["verdict"] in ("INSUFFICIENT_DATA", "NOT_READY")
    with pytest.raises(CollectorUnavailable):
        CollectorClient(f"http://127.0.0.1:{free_port()}", timeout=1).get_run(1)


def db_samples(db: Path, run_id: int) -> list[tuple[str, int]]:
    con = sqlite3.connect(db)
    try:
        return con.execute("SELECT b.producer, s.call FROM samples s JOIN batches b ON b.id = s.batch_id "
                           "WHERE b.run_id = ?", (run_id,)).fetchall()
    finally:
        con.close()


def test_collector_down_spool_then_replay_exactly_once(collector: Collector, tmp_path: Path) -> None:
    client = CollectorClient(collector.url, timeout=2.0)
    run_id = client.register_run(run_body("spool"))["id"]
    spool = Spool(tmp_path / "spool", 64 * 2**20)
    st = Streamer(client, run_id, spool, flush_interval_s=0.05, batch_max=50).start()
    for i in range(100):
        st.submit(sample(i))
    assert st.flush(30)
    collector.stop()
    for i in range(100, 400):
        st.submit(sample(i))
        if i % 50 == 0:
            time.sleep(0.1)  # several batches while down
    assert wait_for(lambda: st._q.empty() and spool.depth() >= 2)
    depth_while_down = spool.depth()
    collector.start()
    st._retry_at = 0.0  # skip the remaining backoff
    assert st.flush(60), st.last_error
    st.close()
    rows = db_samples(collector.db_path, run_id)
    calls = sorted(c for _, c in rows)
    assert calls == list(range(400)), "every sample stored exactly once"
    assert depth_while_down >= 2 and spool.depth() == 0 and st.dropped == 0
    assert client.get_run(run_id)["samples"] == 400


def test_spool_bound_drops_are_counted_and_reported(collector: Collector, tmp_path: Path) -> None:
    client = CollectorClient(collector.url, timeout=2.0)
    run_id = client.register_run(run_body("drops"))["id"]
    dead = CollectorClient(f"http://127.0.0.1:{free_port()}", timeout=1.0)
    spool = Spool(tmp_path / "spool", 4000)  # room for about one small batch
    st = Streamer(dead, run_id, spool, flush_interval_s=0.05, batch_max=10).start()
    for i in range(60):
        st.submit(sample(i))
        if i % 10 == 9:
            time.sleep(0.15)
    assert wait_for(lambda: st._q.empty() and st.dropped > 0)
    dropped = st.dropped
    st.client = client  # the collector is back
    st._retry_at = 0.0
    st.submit(sample(1000))
    assert st.flush(30)
    st.close()
    con = sqlite3.connect(collector.db_path)
    stats = con.execute("SELECT * FROM producers WHERE run_id = ?", (run_id,)).fetchall()
    con.close()
    assert dropped >= 10 and stats, "the producer's drop count reached the collector"
    assert client.get_run(run_id)["samples"] + dropped == 61


def _producer_figures(db_path: Path, run_id: int) -> list[tuple[Any, ...]]:
    con = sqlite3.connect(db_path)
    try:
        return con.execute("SELECT dropped, spool_depth, gaps FROM producers WHERE run_id = ?", (run_id,)).fetchall()
    finally:
        con.close()


def test_drops_reach_the_collector_when_traffic_stopped_before_it_came_back(collector: Collector,
                                                                            tmp_path: Path) -> None:
    """The spool overflows during an outage and the traffic stops before the collector is back: no later batch
    of samples will carry the final drop count, so the idle streamer sends it alone once its spool is delivered.
    The collector then holds exactly the count the producer has."""
    client = CollectorClient(collector.url, timeout=2.0)
    run_id = client.register_run(run_body("idle-drops"))["id"]
    dead = CollectorClient(f"http://127.0.0.1:{free_port()}", timeout=1.0)
    spool = Spool(tmp_path / "spool", 8000)  # room for one batch of 10 samples (~5.6 kB)
    st = Streamer(dead, run_id, spool, flush_interval_s=0.05, batch_max=10, poll_interval_s=0.2).start()
    for i in range(60):
        st.submit(sample(i))
        if i % 10 == 9:
            time.sleep(0.15)
    assert wait_for(lambda: st._q.empty() and st.dropped > 0 and spool.depth() > 0)
    dropped = st.dropped
    st.client = client  # the collector is back; nothing more is submitted
    st._retry_at = 0.0
    # (the dropped batches' seqs are gaps in the sequence the collector saw: it learns of them only now too)
    assert wait_for(lambda: _producer_figures(collector.db_path, run_id) == [(dropped, 0, dropped // 10)]), \
        _producer_figures(collector.db_path, run_id)
    assert st.dropped == dropped and client.get_run(run_id)["samples"] + dropped == 60
    batches = client.get_run(run_id)["batches"]
    time.sleep(0.6)  # figures unchanged: no further stats-only batch
    st.close()
    assert client.get_run(run_id)["batches"] == batches


def test_drops_of_a_producer_none_of_whose_samples_was_stored_reach_the_collector(collector: Collector,
                                                                                 tmp_path: Path) -> None:
    """A spool too small for any batch during an outage: every sample is dropped, so the collector never learns
    the producer's rank from a sample. The streamer knows its rank and states it in its stats-only batch once
    the collector is back; the drops then show under that rank, and nothing else is added to the run."""
    client = CollectorClient(collector.url, timeout=2.0)
    run_id = client.register_run({**run_body("all-dropped"), "tp_size": 2})["id"]
    dead = CollectorClient(f"http://127.0.0.1:{free_port()}", timeout=1.0)
    st = Streamer(dead, run_id, Spool(tmp_path / "spool", 64), flush_interval_s=0.05, batch_max=10,
                  poll_interval_s=0.2, rank=1).start()
    for i in range(30):
        st.submit({**sample(i), "rank": 1})
    assert wait_for(lambda: st._q.empty() and st.dropped == 30 and st.spool.depth() == 0)
    st.client = client
    st._retry_at = 0.0
    assert wait_for(lambda: [r[0] for r in _producer_figures(collector.db_path, run_id)] == [30]), \
        _producer_figures(collector.db_path, run_id)
    con = sqlite3.connect(collector.db_path)
    ranks = con.execute("SELECT rank FROM producers WHERE run_id = ?", (run_id,)).fetchall()
    con.close()
    st.close()
    assert ranks == [(1,)] and client.get_run(run_id)["samples"] == 0


def test_a_producer_that_knows_no_rank_sends_no_figures_before_its_first_stored_batch(collector: Collector,
                                                                                      tmp_path: Path) -> None:
    """Without a rank (a streamer built without one) the figures of a producer the collector has never stored
    a sample of have nowhere to go: the idle streamer does not send them (the collector would refuse them)."""
    client = CollectorClient(collector.url, timeout=2.0)
    run_id = client.register_run(run_body("no-rank"))["id"]
    dead = CollectorClient(f"http://127.0.0.1:{free_port()}", timeout=1.0)
    st = Streamer(dead, run_id, Spool(tmp_path / "spool", 64), flush_interval_s=0.05, batch_max=10,
                  poll_interval_s=0.1).start()
    for i in range(10):
        st.submit(sample(i))
    assert wait_for(lambda: st._q.empty() and st.dropped == 10)
    st.client = client
    st._retry_at = 0.0
    time.sleep(0.8)  # several idle polls against the live collector
    st.close()
    assert client.get_run(run_id)["batches"] == 0 and st.rejected == 0


def test_rejected_batches_are_dropped_not_retried(collector: Collector, tmp_path: Path) -> None:
    client = CollectorClient(collector.url, timeout=2.0)
    run_id = client.register_run(run_body("reject"))["id"]
    st = Streamer(client, run_id, Spool(tmp_path / "s", 2**20), flush_interval_s=0.05).start()
    bad = sample(0)
    bad["layer"] = 99  # beyond num_layers: 422
    st.submit(bad)
    assert st.flush(20)
    st.submit(sample(1))
    assert st.flush(20)
    st.close()
    assert st.rejected == 1 and st.sent == 1 and st.spool.depth() == 0


class Silent:
    """A 'collector' that accepts connections and never answers."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        self.accepted = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            self.accepted.set()


def test_enqueue_never_waits_on_a_collector_that_never_answers(tmp_path: Path) -> None:
    silent = Silent()
    entered = threading.Event()
    release = threading.Event()

    class Probe(httpx.HTTPTransport):
        def handle_request(self, request: httpx.Request) -> httpx.Response:
            entered.set()
            try:
                return super().handle_request(request)
            finally:
                release.wait(30)

    client = CollectorClient(f"http://127.0.0.1:{silent.port}", timeout=60.0, transport=Probe())
    rt, _ = make_runtime("validate")
    st = Streamer(client, 1, Spool(tmp_path / "spool", 2**20), flush_interval_s=0.01, batch_max=5, queue_max=100)
    rt.streamer = st.start()
    rt.sink = None
    site = ShadowSite("s", base_fn, cand_fn, runtime=rt)
    x, w = inputs()
    site(x, w, layer=0)
    assert entered.wait(30) and silent.accepted.wait(30)
    # the sender thread is now blocked inside a POST that will never be answered
    assert st._thread.is_alive()
    n = 1000
    for _ in range(n):
        site(x, w, layer=0)
    assert rt.emitted == n + 1, "every call completed while the sender was blocked"
    assert st._q.qsize() == 100, "bounded memory: the queue holds its maximum"
    # every sample is accounted for: queued, dropped and counted, or held by the blocked sender (the
    # first one, when the request it blocks in is that sample's POST rather than a mode poll)
    held = n + 1 - st._q.qsize() - st.dropped
    assert held in (0, 1), (held, st.dropped)
    release.set()
    silent.sock.close()


def _streaming_on_mode_site(collector: Collector, tmp_path: Path, key: str) -> tuple[int, Any, Streamer, ShadowSite]:
    """An on-mode site streaming to ``collector`` as run ``key`` (its first call delivered): (run id, runtime,
    streamer, site)."""
    client = CollectorClient(collector.url, timeout=2.0)
    run_id = client.register_run(run_body(key))["id"]
    rt, _ = make_runtime("on", spot_every=1)
    rt.sink = None
    st = Streamer(client, run_id, Spool(tmp_path / "s", 2**20), flush_interval_s=0.05, poll_interval_s=0.2,
                  on_mode_override=rt.set_override, stats=rt.producer_stats)
    rt.streamer = st.start()
    site = ShadowSite("s", base_fn, cand_fn, runtime=rt)
    site(*inputs(), layer=0)
    assert st.flush(20) and rt.mode == "on"
    return int(run_id), rt, st, site


def test_kill_switch_reaches_the_hook(collector: Collector, tmp_path: Path) -> None:
    run_id, rt, st, site = _streaming_on_mode_site(collector, tmp_path, "kill")
    x, w = inputs()
    CollectorClient(collector.url).set_mode(run_id, "validate")
    assert wait_for(lambda: rt.mode == "validate", 20), "the poll brought the kill switch"
    assert torch.equal(site(x, w, layer=0), base_fn(x, w))
    CollectorClient(collector.url).set_mode(run_id, "off")
    assert wait_for(lambda: rt.mode == "off", 20)
    CollectorClient(collector.url).set_mode(run_id, None)
    assert wait_for(lambda: rt.mode == "on", 20)
    st.close()


def test_the_command_lines_kill_switch_reaches_the_hook(collector: Collector, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    # the runbook's rollback step as an operator types it: `shadowd mode RUN validate`, then `clear`
    run_id, rt, st, site = _streaming_on_mode_site(collector, tmp_path, "kill-cli")
    x, w = inputs()
    assert main(["mode", str(run_id), "validate", "--url", collector.url]) == 0
    assert f"run {run_id} (kill-cli): kill switch validate (was none)" in capsys.readouterr().out
    assert wait_for(lambda: rt.mode == "validate", 20), "the kill switch set from the command line reached the hook"
    assert torch.equal(site(x, w, layer=0), base_fn(x, w))
    assert main(["mode", str(run_id), "clear", "--url", collector.url]) == 0
    assert wait_for(lambda: rt.mode == "on", 20)
    st.close()


def test_kill_switch_reaches_a_producer_whose_batches_are_all_rejected(collector: Collector, tmp_path: Path) -> None:
    # a rejected batch's answer carries no kill switch: a producer that keeps sending bad batches must still
    # poll for it (it never did: the poll only ran when there was nothing to send)
    client = CollectorClient(collector.url, timeout=2.0)
    run_id = client.register_run(run_body("kill-rejected"))["id"]
    seen: list[str | None] = []
    st = Streamer(client, run_id, Spool(tmp_path / "s", 2**20), flush_interval_s=0.01, poll_interval_s=0.2,
                  batch_max=1, queue_max=1000, on_mode_override=seen.append)
    CollectorClient(collector.url).set_mode(run_id, "off")
    bad = sample(0)
    bad["layer"] = 99  # beyond num_layers: every batch is a 422
    for _ in range(1000):  # one POST per sample: the queue never runs dry while the test watches
        st.submit(dict(bad))
    st.start()
    deadline = time.monotonic() + 10
    while "off" not in seen and time.monotonic() < deadline:
        for _ in range(20):
            st.submit(dict(bad))
        time.sleep(0.005)
    assert st._q.qsize() > 0, "the queue never ran dry"
    st.close(timeout=0.5)
    assert st.rejected > 0 and st.sent == 0
    assert "off" in seen, "the kill switch reached a producer whose every batch was rejected"


def test_spool_files_are_exact_bodies(tmp_path: Path) -> None:
    sp = Spool(tmp_path, 10_000)
    body = b"x" * 100
    assert sp.push(3, "prod", 7, body) and sp.push(3, "prod", 8, body)
    assert not sp.push(3, "prod", 9, b"y" * 20_000)
    again = Spool(tmp_path, 10_000)
    e = again.peek()
    assert e is not None and (e.run_id, e.seq, e.producer) == (3, 7, "prod") and e.read() == body
    again.pop(e)
    assert again.depth() == 1
    assert decode_msgpack(b"\x90") == []


@pytest.mark.parametrize("field,value", [
    ("prefix_len", -1), ("batch_size", 0), ("batch_size", 2**40), ("draft_tokens", 2**31), ("heads", 0),
    ("layer", -2), ("step", 2**60), ("numel", -1), ("ts", float("nan")), ("ts", 1.7e12), ("cand_us", -1.0),
    ("base_us", 1e308), ("nan_cand", -3), ("hist", [-1] * HIST_BINS), ("mode", "off"), ("error", "e" * 201),
    ("new_requests", -3), ("max_abs", -1.0),
])
def test_what_the_hook_leaves_out_is_what_the_collector_refuses(field: str, value: Any) -> None:
    from shadowd.collector.batch import BadBatch
    from shadowd.wire import sample_problem

    good = sample(0)
    assert sample_problem(good) is None
    parse_batch(decode_msgpack(encode_msgpack(build_batch("p", 0, [good]))))
    bad = dict(good, **{field: value})
    problem = sample_problem(bad)
    assert problem is not None and problem[0] == field
    with pytest.raises(BadBatch) as e:
        parse_batch(decode_msgpack(encode_msgpack(build_batch("p", 0, [bad]))))
    assert e.value.field.startswith(f"samples.{field}")


def test_a_sample_the_collector_would_refuse_is_left_out_not_its_batch(collector: Collector, tmp_path: Path) -> None:
    # the collector refuses a batch as a whole: one caller's bad bucket must not cost the good samples beside it
    client = CollectorClient(collector.url, timeout=2.0)
    run_id = client.register_run(run_body("one-bad"))["id"]
    st = Streamer(client, run_id, Spool(tmp_path / "s", 2**20), flush_interval_s=0.05, num_layers=4)
    bad = [dict(sample(100), prefix_len=-1), dict(sample(101), layer=4), dict(sample(102), batch_size=2**40),
           dict(sample(103), hist=[1, 2, 3]), dict(sample(104), cand_us=1e308)]
    for i in range(10):  # queued before the thread starts: one batch of 15
        st.submit(sample(i))
        if i < len(bad):
            st.submit(bad[i])
    st.start()
    assert st.flush(20)
    st.close()
    assert st.sent == 10 and st.rejected == st.invalid == 5 and st.dropped == 0
    assert client.get_run(run_id)["samples"] == 10
    # the collector hears of them: the producer's figure, exported per (stage, rank) (the samples' rank: 0)
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{collector.url}/metrics", timeout=5).text
    got = {tuple(sorted(s.labels.items())): s.value for f in text_string_to_metric_families(text)
           for s in f.samples if s.name == "shadowd_producer_rejected_samples"}
    assert got == {(("rank", "0"), ("run", str(run_id)), ("stage", "0")): 5.0}, got


def test_start_streaming_registers_applies_kill_switch_and_delivers(collector: Collector, tmp_path: Path) -> None:
    from shadowd.hook.config import HookConfig
    from shadowd.hook.runtime import HookRuntime

    admin = CollectorClient(collector.url)
    run_id = admin.register_run(run_body("start"))["id"]
    admin.set_mode(run_id, "validate")
    rt = HookRuntime(HookConfig(mode="on", url=collector.url, run_key="start", spool_dir=tmp_path / "spool",
                                flush_interval_s=0.05))
    st = rt.start_streaming({k: v for k, v in run_body("x").items() if k != "run_key"})
    assert rt.run_id == run_id and rt.mode == "validate", "the registration answer carries the kill switch"
    site = ShadowSite("s", base_fn, cand_fn, runtime=rt)
    x, w = inputs()
    for layer in range(4):
        site(x, w, layer=layer)
    assert st.flush(30)
    st.close()
    assert admin.get_run(run_id)["samples"] == 4


def test_a_process_that_exits_without_closing_its_streamer_loses_nothing(collector: Collector, tmp_path: Path) -> None:
    # outside SGLang (whose plugin closes its streamer at exit) start_streaming's streamer is closed at exit too:
    # what is still queued when the process ends is delivered, not lost with the daemon thread
    import subprocess
    import sys

    script = f"""
from shadowd.hook.config import HookConfig
from shadowd.hook.runtime import HookRuntime
from tests.hook.conftest import run_body
from tests.hook.test_streamer import sample
rt = HookRuntime(HookConfig(mode="validate", url={collector.url!r}, run_key="atexit",
                            spool_dir={str(tmp_path / "spool")!r}, flush_interval_s=0.05))
st = rt.start_streaming({{k: v for k, v in run_body("x").items() if k != "run_key"}})
for i in range(200):
    st.submit(sample(i, layer=i % 4))
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
    admin = CollectorClient(collector.url)
    run_id = admin.register_run(run_body("atexit"))["id"]  # (idempotent per run key: the subprocess's run)
    assert admin.get_run(run_id)["samples"] == 200


def test_why_the_candidate_was_disabled_reaches_the_collector(collector: Collector, tmp_path: Path) -> None:
    """The hook's reason travels with its batches (``producer_notes``) to the producer's row, the readiness
    answer and ``shadowd readiness``' report."""
    import httpx

    from shadowd.hook.config import HookConfig
    from shadowd.hook.runtime import HookRuntime
    from shadowd.readiness_cli import format_report

    admin = CollectorClient(collector.url)
    rt = HookRuntime(HookConfig(mode="validate", url=collector.url, run_key="notes", spool_dir=tmp_path / "spool",
                                flush_interval_s=0.05))
    st = rt.start_streaming({k: v for k, v in run_body("x").items() if k != "run_key"})

    def scribbler(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        w.add_(0)  # an in-place write to an input shared with the candidate: disabled at once
        return cand_fn(x, w)

    site = ShadowSite("s", base_fn, scribbler, runtime=rt, clone_max_bytes=1024)
    x, w = inputs()
    for layer in range(2):
        site(x, w, layer=layer)
    assert st.flush(30)
    st.close()
    assert rt.disabled and admin.get_run(rt.run_id)["samples"] == 1
    (prod,) = httpx.get(f"{collector.url}/v1/runs/{rt.run_id}/producers").json()
    assert prod["disabled_reason"] == "candidate modified its inputs" and prod["fallback_reason"] is None
    ready = httpx.get(f"{collector.url}/readiness", params={"run_id": rt.run_id}).json()
    assert ready["producer_notes"] == [{"stage": 0, "rank": 0, "producer": prod["producer"],
                                        "disabled_reason": "candidate modified its inputs", "fallback_reason": None}]
    assert "rank 0: candidate disabled: candidate modified its inputs" in format_report(ready)


def test_a_pipeline_stage_that_disabled_its_candidate_is_seen_beside_a_healthy_stage_of_its_rank(
        collector: Collector, tmp_path: Path) -> None:
    """Two stages of one TP rank on one host (one spool root, one run key): stage 1's candidate writes to its
    inputs and is disabled; stage 0's stays healthy and started later. The collector's gauges, the producer rows
    and the verdict's reason say which stage gave up; each stage spooled into its own directory."""
    from shadowd.hook.config import HookConfig
    from shadowd.hook.runtime import HookRuntime
    from shadowd.readiness_cli import format_report

    def scribbler(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        w.add_(0)
        return cand_fn(x, w)

    runtimes = {}
    for stage, cand, layers in ((1, scribbler, (2, 3)), (0, cand_fn, (0, 1))):
        rt = HookRuntime(HookConfig(mode="validate", url=collector.url, run_key="pp", spool_dir=tmp_path / "spool",
                                    flush_interval_s=0.05, stage=stage))
        st = rt.start_streaming({k: v for k, v in run_body("x").items() if k != "run_key"})
        site = ShadowSite("s", base_fn, cand, runtime=rt, clone_max_bytes=1024)
        x, w = inputs()
        for layer in layers:
            site(x, w, layer=layer)
        assert st.flush(30)
        st.close()
        runtimes[stage] = rt
        time.sleep(0.01)
    assert runtimes[1].disabled and not runtimes[0].disabled and runtimes[0].run_id == runtimes[1].run_id
    assert runtimes[0].streamer is not None and runtimes[1].streamer is not None
    assert runtimes[0].streamer.spool.root != runtimes[1].streamer.spool.root
    run_id = runtimes[0].run_id
    prods = {p["stage"]: p for p in httpx.get(f"{collector.url}/v1/runs/{run_id}/producers").json()}
    assert prods[1]["rank"] == prods[0]["rank"] == 0 and prods[1]["disabled"] == 1 and prods[0]["disabled"] == 0
    metrics = httpx.get(f"{collector.url}/metrics", timeout=5.0).text
    assert f'shadowd_producer_candidate_disabled{{rank="0",run="{run_id}",stage="1"}} 1.0' in metrics
    assert f'shadowd_producer_candidate_disabled{{rank="0",run="{run_id}",stage="0"}} 0.0' in metrics
    ready = httpx.get(f"{collector.url}/readiness", params={"run_id": run_id}).json()
    report = format_report(ready)
    assert "stage 1 rank 0 (producer " in report and ready["verdict"] == "NOT_READY"
    assert "  stage 1 rank 0: candidate disabled: candidate modified its inputs" in report.splitlines()


def test_every_post_carries_its_send_stamp(collector: Collector, tmp_path: Path) -> None:
    """The hook's client stamps each post with its send time, so the collector exports this rank's clock offset
    (near 0 here: one machine, one clock)."""
    client = CollectorClient(collector.url, timeout=2.0)
    run_id = client.register_run(run_body("stamp"))["id"]
    client.post_batch(run_id, encode_msgpack(build_batch("p", 0, [sample(0)])))
    text = httpx.get(f"{collector.url}/metrics", timeout=5.0).text
    line = next(x for x in text.splitlines() if x.startswith("shadowd_producer_clock_offset_seconds{")
                and f'run="{run_id}"' in x and 'rank="0"' in x)
    assert abs(float(line.split()[-1])) < 5.0, line
