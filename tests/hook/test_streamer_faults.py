"""The streamer under faults a deployment meets: spool files that vanish, a previous run's leftovers, a batch the
collector fails on, a long outage's replay, exit with a collector that never answers, a run not yet registered."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest

import shadowd.hook.streamer as streamer_mod
from shadowd.client import CollectorClient
from shadowd.hook.spool import PENDING_RUN, Spool, spool_dir
from shadowd.hook.streamer import Streamer
from shadowd.wire import decode_msgpack, encode_msgpack
from tests.hook.conftest import Collector, run_body, wait_for
from tests.hook.test_streamer import Silent, db_samples, sample


def _calls(collector: Collector, run_id: int) -> list[int]:
    return sorted(c for _, c in db_samples(collector.db_path, run_id))


def test_a_spooled_batch_that_vanished_is_skipped_and_later_samples_arrive(collector: Collector,
                                                                         tmp_path: Path) -> None:
    # (two producers sharing a spool directory: one delivers and deletes a file the other had listed)
    client = CollectorClient(collector.url, timeout=2.0)
    run_id = client.register_run(run_body("vanish"))["id"]
    spool = Spool(tmp_path / "spool", 2**20)
    for seq in range(3):
        assert spool.push(run_id, "other", seq, encode_msgpack(_batch("other", seq, [seq])), 1)
    spool.peek()  # listed
    next(p for p in (tmp_path / "spool").glob("*.mpk") if "-00000000000000000001-" in p.name).unlink()
    st = Streamer(client, run_id, spool, flush_interval_s=0.05).start()
    for i in range(10, 20):
        st.submit(sample(i))
    assert st.flush(30), st.last_error
    st.close()
    assert _calls(collector, run_id) == [0, 2, *range(10, 20)]
    assert st.dropped == 0 and spool.depth() == 0


def test_what_an_earlier_process_of_the_run_key_spooled_goes_to_the_run(collector: Collector, tmp_path: Path) -> None:
    # (deleted unsent, before, as "another run's leftovers"; and sent to its recorded run id, which a collector
    # whose database was made anew gives to another run: a spool directory belongs to one run key now)
    client = CollectorClient(collector.url, timeout=2.0)
    unrelated = client.register_run(run_body("someone-else"))["id"]
    run_id = client.register_run(run_body("launch"))["id"]
    root = spool_dir(tmp_path, "launch", 0)
    spool = Spool(root, 2**20)
    assert spool.push(unrelated, "p1", 0, encode_msgpack(_batch("p1", 0, [1, 2])), 2)  # an id of an old database
    assert spool.push(PENDING_RUN, "p2", 0, encode_msgpack(_batch("p2", 0, [3])), 1)  # before its registration
    st = Streamer(client, run_id, Spool(root, 2**20), flush_interval_s=0.05).start()
    st.submit(sample(7))
    assert st.flush(30), st.last_error
    st.close()
    assert _calls(collector, run_id) == [1, 2, 3, 7] and _calls(collector, unrelated) == []
    assert spool_dir(tmp_path, "another-launch", 0) != root


def test_a_batch_the_collector_keeps_failing_on_is_dropped_counted_and_the_rest_flows(tmp_path: Path,
                                                                                    monkeypatch: pytest.MonkeyPatch
                                                                                    ) -> None:
    # 500 (not 503: the database is up) on every try of one batch: it wedged every later batch behind it
    monkeypatch.setattr(streamer_mod, "BUG_TRIES", 3)
    stored: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":  # the kill-switch poll
            return httpx.Response(200, json={"id": 1})
        body = decode_msgpack(request.content)
        if body["seq"] == 0:
            return httpx.Response(500, json={"detail": "internal error"})
        stored.append(body["seq"])
        return httpx.Response(200, json={"accepted": 1})

    client = CollectorClient("http://collector", transport=httpx.MockTransport(handler))
    st = Streamer(client, 1, Spool(tmp_path / "spool", 2**20), flush_interval_s=0.05, batch_max=1).start()
    for i in range(4):
        st.submit(sample(i))
    st._backoff = 0.05
    assert wait_for(lambda: stored == [1, 2, 3], 30), (stored, st.last_error)
    st.close()
    assert st.rejected == 1 and st.sent == 3


def test_replay_takes_turns_with_the_queue(tmp_path: Path) -> None:
    # a long outage's spool is replayed a round at a time; the queue's samples go behind it meanwhile (they were
    # left in memory until the whole spool was sent, and the queue overflowed)
    posted: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":  # the kill-switch poll
            return httpx.Response(200, json={"id": 1})
        posted.append(decode_msgpack(request.content)["seq"])
        return httpx.Response(200, json={})

    client = CollectorClient("http://collector", transport=httpx.MockTransport(handler))
    spool = Spool(tmp_path / "spool", 2**22)
    st = Streamer(client, 1, spool, flush_interval_s=0.05, batch_max=100)
    for seq in range(40):
        assert spool.push(1, st.producer, seq, encode_msgpack(_batch(st.producer, seq, [seq])), 1)
    st.seq = 40
    for i in range(5):
        st.submit(sample(100 + i))
    samples, taken = st._take()  # (one round of the thread's loop, run here)
    st._replay()
    st._ship(samples)
    st._done += taken
    assert posted == list(range(streamer_mod.REPLAY_ROUND)), "one round of the spool"
    assert spool.depth() == 40 - streamer_mod.REPLAY_ROUND + 1, "the queue's samples spooled behind it, in order"
    st.start()
    assert st.flush(30)
    st.close()
    assert posted == list(range(41))


def test_close_spools_what_a_silent_collector_holds_and_the_next_start_delivers_it(collector: Collector,
                                                                                  tmp_path: Path) -> None:
    client = CollectorClient(collector.url, timeout=2.0)
    run_id = client.register_run(run_body("exit"))["id"]
    silent = Silent()
    entered = threading.Event()

    class Probe(httpx.HTTPTransport):
        def handle_request(self, request: httpx.Request) -> httpx.Response:
            entered.set()
            return super().handle_request(request)

    hung = CollectorClient(f"http://127.0.0.1:{silent.port}", timeout=60.0, transport=Probe())
    st = Streamer(hung, run_id, Spool(tmp_path / "spool", 2**20), flush_interval_s=0.05, batch_max=10).start()
    for i in range(5):
        st.submit(sample(i))
    assert entered.wait(30)
    time.sleep(0.2)
    for i in range(5, 25):
        st.submit(sample(i))
    t0 = time.monotonic()
    st.close(timeout=0.5)
    assert time.monotonic() - t0 < 5, "exit stays bounded"
    assert st.spool.depth() >= 3 and st.dropped == 0, "the batch in flight and the queue, spooled"
    silent.sock.close()
    st2 = Streamer(client, run_id, Spool(tmp_path / "spool", 2**20), flush_interval_s=0.05).start()
    assert st2.flush(30), st2.last_error
    st2.close()
    assert _calls(collector, run_id) == list(range(25)), "every sample stored exactly once"


def test_samples_before_the_run_is_registered_are_spooled_then_delivered(collector: Collector,
                                                                        tmp_path: Path) -> None:
    client = CollectorClient(collector.url, timeout=2.0)
    spool = Spool(tmp_path / "spool", 2**20)
    st = Streamer(client, PENDING_RUN, spool, flush_interval_s=0.05, batch_max=10).start()
    for i in range(30):
        st.submit(sample(i))
    assert wait_for(lambda: st._q.empty() and spool.depth() >= 1)
    st.run_id = client.register_run(run_body("late"))["id"]  # the collector answered the registration at last
    assert st.flush(30), st.last_error
    st.close()
    assert _calls(collector, st.run_id) == list(range(30)) and st.dropped == 0


def _batch(producer: str, seq: int, calls: list[int]) -> dict:
    from shadowd.hook.streamer import build_batch

    return build_batch(producer, seq, [sample(c) for c in calls])


def test_a_refused_token_keeps_the_batches_for_a_restart_with_the_right_one(tmp_path: Path) -> None:
    good: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.headers.get("Authorization") != "Bearer right":
            return httpx.Response(401, json={"detail": "bad token"})
        if request.method == "POST":
            good.append(decode_msgpack(request.content)["seq"])
        return httpx.Response(200, json={"id": 1})

    def client(token: str) -> CollectorClient:
        return CollectorClient("http://collector", token=token, transport=httpx.MockTransport(handler))

    st = Streamer(client("rotated"), 1, Spool(tmp_path / "spool", 2**20), flush_interval_s=0.05).start()
    for i in range(5):
        st.submit(sample(i))
    assert wait_for(lambda: st._q.empty() and st.spool.depth() >= 1)
    st.close(timeout=0.5)
    assert st.rejected == 0 and st.dropped == 0 and good == []
    st2 = Streamer(client("right"), 1, Spool(tmp_path / "spool", 2**20), flush_interval_s=0.05).start()
    assert st2.flush(30), st2.last_error
    st2.close()
    assert good and st2.spool.depth() == 0


def test_a_forked_child_streams_as_a_producer_of_its_own(collector: Collector, tmp_path: Path) -> None:
    # (the child inherited a dead thread, the parent's queue lock and connections: its samples went nowhere, and
    # the kill switch never reached it)
    import os

    client = CollectorClient(collector.url, timeout=5.0)
    run_id = client.register_run(run_body("fork"))["id"]
    seen: list[str | None] = []
    st = Streamer(client, run_id, Spool(tmp_path / "spool", 2**20), flush_interval_s=0.05,
                  on_mode_override=seen.append).start()
    st.submit(sample(1))
    assert st.flush(30)
    client.set_mode(run_id, "off")
    pid = os.fork()
    if pid == 0:  # the child: report through the exit status only
        ok = False
        try:
            st.submit(sample(2))
            ok = st.flush(30) and st.sent == 1 and "off" in seen
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    st.close()
    assert os.waitstatus_to_exitcode(status) == 0, "the child delivered its sample and heard the kill switch"
    rows = db_samples(collector.db_path, run_id)
    assert sorted(c for _, c in rows) == [1, 2] and len({p for p, _ in rows}) == 2, rows


def test_a_collector_older_than_the_hook_gets_every_sample_without_the_figures_it_does_not_know(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # the collector's own batch check, as a collector from before the on-mode shape counters runs it: it refuses a
    # batch naming the first figure it does not know; the hook leaves that figure out from then on and loses nothing
    import shadowd.collector.batch as batch_mod
    from shadowd.collector.batch import BadBatch, parse_batch
    from shadowd.wire import PRODUCER_STATS

    monkeypatch.setattr(batch_mod, "PRODUCER_STATS", tuple(k for k in PRODUCER_STATS if not k.startswith("on_")))
    stored: list[tuple[int, dict[str, int]]] = []
    refused: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":  # the kill-switch poll
            return httpx.Response(200, json={"id": 1})
        body = decode_msgpack(request.content)
        try:
            parse_batch(body)
        except BadBatch as e:  # the collector's 422 answer
            refused.append(e.field)
            return httpx.Response(422, json={"detail": {"field": e.field, "error": e.message}})
        stored.append((body["seq"], body.get("producer_stats", {})))
        return httpx.Response(200, json={"accepted": 1})

    figures = {"device_errors": 0, "on_covered_calls": 7, "on_uncovered_calls": 2}
    client = CollectorClient("http://collector", transport=httpx.MockTransport(handler))
    st = Streamer(client, 1, Spool(tmp_path / "spool", 2**20), flush_interval_s=0.05, batch_max=1,
                  stats=lambda: dict(figures)).start()
    with caplog.at_level("WARNING", logger="shadowd"):
        for i in range(3):
            st.submit(sample(i))
        assert st.flush(30)
    st.close()
    assert refused == ["producer_stats.on_covered_calls", "producer_stats.on_uncovered_calls"], refused
    assert [seq for seq, _ in stored] == [0, 1, 2] and st.rejected == 0 and st.sent == 3
    assert all("device_errors" in s and not any(k.startswith("on_") for k in s) for _, s in stored), stored
    assert st.unknown_fields == {"on_covered_calls", "on_uncovered_calls"}
    assert caplog.text.count("does not know the producer figure") == 2
