"""The ingest writer processes (SQLite): same rows as inline ingest, restart after a crash, several writers."""

from __future__ import annotations

import logging
import os
import signal
import sqlite3
import threading
import time

import pytest
from sqlalchemy import create_engine, select

from shadowd.collector import tables as t
from shadowd.collector.batch import parse_batch
from tests.collector.helpers import count_rows, post_msgpack, register, sample_rows
from tests.factories import make_batch, run_body


def _rollups(db_url: str) -> dict[str, list[tuple]]:
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            return {
                table.name: sorted(tuple(r) for r in conn.execute(select(table)).all())
                for table in (t.cells, t.timeslots, t.hists, t.steps)
            }
    finally:
        engine.dispose()


def test_writer_process_stores_what_inline_ingest_stores(tmp_path, make_client):
    urls = {mode: f"sqlite:///{tmp_path / mode}.db" for mode in ("process", "inline")}
    for mode, url in urls.items():
        c = make_client(url, ingest_writer=mode)
        assert (c.app.state.shadowd.writer is not None) == (mode == "process")
        run_id = register(c, run_body(num_layers=4))
        rel = [3e-3] * 200
        rel[17] = 0.5
        batch = make_batch(200, packed=True, rel_l2=rel, mode="on", error=[None] * 199 + ["shape"])
        assert post_msgpack(c, run_id, batch).json()["accepted"] == 200
        assert post_msgpack(c, run_id, batch).json()["duplicate"] is True
        bad = make_batch(8, seq=1, layer=[0, 1, 2, 3, 4, 0, 1, 2])
        r = post_msgpack(c, run_id, bad)
        assert r.status_code == 422 and r.json()["detail"]["field"] == "samples.layer[4]"
        assert c.get(f"/v1/runs/{run_id}").json()["exceeded_calls"] >= 1
        # a stats-only batch (the refused seq 1 was rolled back: free), and one from a producer never seen
        figures = {"producer": batch["producer"], "seq": 1, "samples": {}, "producer_stats": {"dropped": 9}}
        assert post_msgpack(c, run_id, figures).json() == {"run_id": run_id, "accepted": 0, "duplicate": False,
                                                           "mode_override": None}
        r = post_msgpack(c, run_id, {**figures, "producer": "stranger"})
        assert r.status_code == 422 and r.json()["detail"]["field"] == "producer"
    rows = {mode: [{k: v for k, v in r.items() if k != "id"} for r in sample_rows(url)] for mode, url in urls.items()}
    assert len(rows["process"]) == 200 and rows["process"] == rows["inline"]
    roll = {mode: _rollups(url) for mode, url in urls.items()}
    assert roll["process"] == roll["inline"]


def test_a_dead_writer_is_replaced_and_loses_nothing_committed(fresh_sqlite, make_client):
    c = make_client(fresh_sqlite)
    run_id = register(c, run_body(num_layers=4))
    assert post_msgpack(c, run_id, make_batch(40, seq=0, packed=True)).status_code == 200
    writer = c.app.state.shadowd.writer
    (pid,) = writer.pids
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while writer._workers[0].conn is not None and time.monotonic() < deadline:
        time.sleep(0.02)
    r = post_msgpack(c, run_id, make_batch(40, seq=1, step0=10, packed=True))
    assert r.status_code == 200, r.text
    assert writer.pids != [pid]
    assert count_rows(fresh_sqlite, t.samples) == 80
    assert c.get(f"/v1/runs/{run_id}").json()["batches"] == 2


@pytest.mark.skipif(not hasattr(os, "waitid"), reason="waitid(WNOWAIT) is how the test sees an uncollected child")
def test_a_writer_that_ended_is_left_to_its_process_object(fresh_sqlite, make_client, caplog):
    """The reader thread that sees its writer end logs the exit code without collecting the process: a thread in the
    writer's ``join`` or ``is_alive`` would otherwise lose the race for it, get ECHILD and take it for alive."""
    c = make_client(fresh_sqlite)
    proc = c.app.state.shadowd.writer._workers[0].proc
    with caplog.at_level(logging.ERROR, logger="shadowd.collector"):
        os.kill(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while "ingest writer 0 exited" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.02)
    assert "ingest writer 0 exited (code -9)" in caplog.text
    assert os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None, "collected by the reader"
    proc.join(5)
    assert not proc.is_alive() and proc.exitcode == -9


def _holding_sqlites_write_lock(db_url: str) -> sqlite3.Connection:
    """A connection holding SQLite's write lock: a writer that takes a batch now waits for it inside the writers'
    own lock (in BEGIN IMMEDIATE's busy timeout), until the connection rolls back."""
    con = sqlite3.connect(db_url.removeprefix("sqlite:///"), isolation_level=None)
    con.execute("BEGIN IMMEDIATE")
    return con


def test_a_writer_killed_holding_the_write_lock_stalls_no_later_batch(fresh_sqlite, make_client):
    """A writer SIGKILLed (the OOM killer) inside its write: the batch it had in hand answers 503, and every later
    batch, through the other writer and through the dead one's successor, is stored exactly once."""
    c = make_client(fresh_sqlite, ingest_writer_processes=2)
    writer = c.app.state.shadowd.writer
    run_id = register(c, run_body(num_layers=4))
    n, per = 40, 6

    def batch(producer: str, seq: int) -> dict:
        return make_batch(n, producer=producer, seq=seq, step0=seq * n, packed=True)

    assert post_msgpack(c, run_id, batch("a", 0)).status_code == 200
    blocker = _holding_sqlites_write_lock(fresh_sqlite)
    in_hand: list[int] = []
    held = threading.Thread(target=lambda: in_hand.append(post_msgpack(c, run_id, batch("a", 1)).status_code))
    held.start()  # writer 0 (the one with fewest jobs) takes it and waits inside the writers' lock
    time.sleep(1.0)
    victim = writer.pids[0]
    os.kill(victim, signal.SIGKILL)
    held.join(20)
    blocker.rollback()
    blocker.close()
    assert in_hand == [503]

    # producers stream on, re-sending what was answered 503 (as the hook's streamer does)
    answers: dict[str, list[int]] = {"a": [], "b": []}
    stop = threading.Event()

    def produce(producer: str, first: int) -> None:
        for seq in range(first, per):
            for _ in range(100):
                if stop.is_set():
                    return
                r = post_msgpack(c, run_id, batch(producer, seq))
                answers[producer].append(r.status_code)
                if r.status_code != 503:
                    break
                time.sleep(0.05)

    streams = [threading.Thread(target=produce, args=("a", 1), daemon=True),
               threading.Thread(target=produce, args=("b", 0), daemon=True)]
    for th in streams:
        th.start()
    for th in streams:
        th.join(60)
    stop.set()
    assert not any(th.is_alive() for th in streams), f"ingest stalled after the kill: {answers}"
    assert all(s == 200 for s in answers["a"] + answers["b"]), answers
    assert victim not in writer.pids
    run = c.get(f"/v1/runs/{run_id}").json()
    assert run["batches"] == 2 * per and run["samples"] == 2 * per * n and run["duplicate_batches"] == 0
    assert count_rows(fresh_sqlite, t.samples) == 2 * per * n
    for producer in answers:
        assert count_rows(fresh_sqlite, t.batches, producer=producer) == per


def test_a_writer_whose_http_process_is_gone_ends_at_once(fresh_sqlite, make_client):
    """The HTTP process killed (its end of the jobs pipe closed without a stop): its writer ends now, also while it
    waits inside a write, rather than surviving it as an orphan."""
    c = make_client(fresh_sqlite)
    writer = c.app.state.shadowd.writer
    run_id = register(c, run_body(num_layers=4))
    blocker = _holding_sqlites_write_lock(fresh_sqlite)
    try:
        answer: list[int] = []
        held = threading.Thread(target=lambda: answer.append(post_msgpack(c, run_id, make_batch(8)).status_code))
        held.start()
        # the batch in the writer's hands (registered, then sent; a loaded machine may take seconds to get there:
        # a fixed sleep closed the pipe first, and the batch then went to a new writer that waited on the lock)
        deadline = time.monotonic() + 30
        while not writer._workers[0].pending and time.monotonic() < deadline:
            time.sleep(0.02)
        assert writer._workers[0].pending, "the batch never reached the writer"
        time.sleep(0.5)
        proc = writer._workers[0].proc
        writer._workers[0].conn.close()  # what the HTTP process's death does to the pipe
        proc.join(20)
        assert not proc.is_alive(), "the writer outlived its HTTP process"
        held.join(10)
        assert answer == [503]
    finally:
        blocker.rollback()
        blocker.close()
    assert count_rows(fresh_sqlite, t.samples) == 0


def test_several_writer_processes_share_the_write_lock(fresh_sqlite, make_client):
    c = make_client(fresh_sqlite, ingest_writer_processes=2)
    assert len(c.app.state.shadowd.writer.pids) == 2
    run_id = register(c, run_body(num_layers=4))
    errors: list[str] = []

    def feed(producer: str) -> None:
        for seq in range(8):
            r = post_msgpack(c, run_id, make_batch(300, producer=producer, seq=seq, step0=seq * 100, packed=True))
            if r.status_code != 200:
                errors.append(r.text)

    threads = [threading.Thread(target=feed, args=(p,)) for p in ("a", "b", "c")]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert count_rows(fresh_sqlite, t.samples) == 3 * 8 * 300
    run = c.get(f"/v1/runs/{run_id}").json()
    assert run["samples"] == 7200 and run["batches"] == 24
    assert sum(x["samples"] for x in c.get(f"/v1/runs/{run_id}/layers").json()["layers"]) == 7200


def test_a_batch_stored_by_an_older_collector_is_still_a_duplicate(db_url, make_client):
    """Batches stored before the digest moved to the decoded columns carry the older digest."""
    c = make_client(db_url)
    run_id = register(c, run_body(num_layers=4))
    batch = make_batch(20, seq=3)
    legacy = parse_batch(batch).legacy_digest()
    assert legacy is not None and not legacy.startswith("v2:")
    engine = create_engine(db_url)
    with engine.begin() as conn:
        conn.execute(t.batches.insert().values(run_id=run_id, producer="p-test", seq=3, digest=legacy, n_samples=20,
                                               received_at=time.time(), max_ts=1.8e9))
    engine.dispose()
    again = post_msgpack(c, run_id, batch)
    assert again.status_code == 200 and again.json()["duplicate"] is True
    other = post_msgpack(c, run_id, make_batch(20, seq=3, rel_l2=9e-3))
    assert other.status_code == 409 and other.json()["detail"]["field"] == "seq"
    assert c.get(f"/v1/runs/{run_id}").json()["duplicate_batches"] == 1
    assert count_rows(db_url, t.samples) == 0
