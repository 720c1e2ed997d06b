"""Ingest throughput: end-to-end records/s over HTTP beside the raw bulk-insert rate, same run.

For each database (SQLite file in WAL mode; PostgreSQL when reachable) this

1. measures the raw rate: the same sample rows bulk-inserted straight into the same ``samples``
   table of a database made the same way (``shadowd db upgrade``, the collector's connection
   settings: WAL, synchronous=NORMAL on SQLite), one transaction per batch, with no HTTP,
   validation or rollups. The statement and its data are the collector's own
   (``Store.sample_insert``), built before the clock starts: on SQLite one ``executemany`` of
   prebuilt tuples, on PostgreSQL one ``COPY ... FROM STDIN (FORMAT BINARY)`` of a prebuilt
   stream. SQLite is measured twice — with SQLite's default autocheckpoint, and with the WAL
   checkpointed by another process as the collector does (its checkpointer) — and the faster
   of the two is the baseline;
2. starts ``shadowd serve`` (uvicorn, one HTTP process and its ingest writer process on SQLite)
   on a fresh database and posts pre-encoded msgpack batches of realistic size (61 layers × 64
   verify steps = 3 904 samples, numeric columns packed as the hook's streamer sends them) over
   one keep-alive connection per client thread, measuring records/s and per-batch latency.

Prints a table and appends it to bench/results/ingest-<date>.md with date, machine and commit.
Usage: python bench/ingest.py [--batches 60] [--clients 2] [--rounds 3] [--pg URL | --no-pg]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.provenance import append_results, commit  # noqa: E402
from shadowd.collector.batch import parse_batch  # noqa: E402
from shadowd.collector.db import make_engine, upgrade  # noqa: E402
from shadowd.collector.store import Store  # noqa: E402
from shadowd.collector.writer import CHECKPOINT_INTERVAL_S, checkpoint_loop  # noqa: E402
from shadowd.judge.policy import Policy  # noqa: E402
from shadowd.wire import MSGPACK, encode_msgpack  # noqa: E402
from tests.factories import make_batch, run_body  # noqa: E402

LAYERS = 61
STEPS_PER_BATCH = 64
PG_DEFAULT = os.environ.get("SHADOWD_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def batches(n: int) -> list[dict]:
    per = LAYERS * STEPS_PER_BATCH
    return [make_batch(per, num_layers=LAYERS, packed=True, seq=i, step0=i * STEPS_PER_BATCH,
                       producer="bench", seed=i, ts0=time.time()) for i in range(n)]


def raw_rate(url: str, data: list[dict], background_checkpoint: bool = False) -> float:
    """Rows/s of a plain bulk insert of the same rows into the same table (see the module docstring)."""
    upgrade(url)
    engine = make_engine(url)
    checkpointer = None
    if background_checkpoint:  # the collector's checkpointer, in another process as in the collector
        import multiprocessing

        from sqlalchemy import event

        @event.listens_for(engine, "connect")
        def _no_autocheckpoint(dbapi_conn, _record) -> None:
            dbapi_conn.execute("PRAGMA wal_autocheckpoint=0")

        ctx = multiprocessing.get_context("spawn")
        stop = ctx.Event()
        checkpointer = ctx.Process(target=checkpoint_loop, args=(engine.url.database, stop, CHECKPOINT_INTERVAL_S),
                                   daemon=True)
        checkpointer.start()  # before the rows are built: it has started when the clock starts
    store = Store(engine, Policy())
    # the collector's own statement and data for each batch, built before the clock starts
    jobs = [store.prepare(1, parse_batch(b)) for b in data]
    prepared = [store.sample_insert(job, k + 1) for k, job in enumerate(jobs)]
    total = sum(job.n for job in jobs)
    # straight on the driver's connection: one transaction per batch, nothing else
    raw = engine.raw_connection()
    con = raw.driver_connection
    cur = con.cursor()
    t0 = time.perf_counter()
    for sql, rows in prepared:
        if engine.dialect.name == "postgresql":
            with cur.copy(sql) as cp:
                cp.write(rows)
            con.commit()
        else:
            cur.execute("BEGIN IMMEDIATE")
            cur.executemany(sql, rows)
            cur.execute("COMMIT")
    elapsed = time.perf_counter() - t0
    cur.close()
    raw.close()
    if checkpointer is not None:
        if not checkpointer.is_alive():
            raise RuntimeError(f"the checkpointer process exited early (code {checkpointer.exitcode})")
        stop.set()
        checkpointer.join()
    engine.dispose()
    return total / elapsed


def http_rate(url: str, data: list[dict], clients: int) -> tuple[float, float, float]:
    """End-to-end records/s and p50/p99 batch latency (ms) through ``shadowd serve``."""
    port = free_port()
    env = {**os.environ, "SHADOWD_RETENTION_HOURS": "0"}
    proc = subprocess.Popen([sys.executable, "-m", "shadowd", "serve", "--db", url, "--port", str(port),
                             "--upgrade", "--log-level", "warning"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(200):
            try:
                if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        else:
            raise RuntimeError(proc.stderr.read().decode() if proc.stderr else "server did not start")
        run_id = httpx.post(f"{base}/v1/runs", json=run_body(num_layers=LAYERS)).json()["id"]
        bodies = []
        for k in range(clients):
            for b in data:
                bodies.append((k, encode_msgpack({**b, "producer": f"bench-{k}"})))
        warm = encode_msgpack(make_batch(61, num_layers=LAYERS, producer="warm", seq=0))
        httpx.post(f"{base}/v1/runs/{run_id}/samples", content=warm, headers={"content-type": MSGPACK})
        lat: list[float] = []
        lock = threading.Lock()

        def client(k: int) -> None:
            with httpx.Client(base_url=base, timeout=60) as http:
                for kk, body in bodies:
                    if kk != k:
                        continue
                    t0 = time.perf_counter()
                    r = http.post(f"/v1/runs/{run_id}/samples", content=body, headers={"content-type": MSGPACK})
                    r.raise_for_status()
                    with lock:
                        lat.append(time.perf_counter() - t0)

        threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
        t0 = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        elapsed = time.perf_counter() - t0
        stored = httpx.get(f"{base}/v1/runs/{run_id}").json()["samples"] - 61  # less the warm-up batch
        expected = clients * sum(len(b["samples"]["layer"]) // 8 for b in data)
        if stored != expected:
            raise RuntimeError(f"stored {stored} samples, sent {expected}")
        arr = np.array(lat) * 1000
        return expected / elapsed, float(np.percentile(arr, 50)), float(np.percentile(arr, 99))
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def pg_fresh(admin_url: str) -> tuple[str, callable]:
    import psycopg
    from sqlalchemy.engine import make_url

    u = make_url(admin_url)
    kw = {"host": u.host, "port": u.port or 5432, "user": u.username, "password": u.password, "dbname": u.database,
          "autocommit": True}
    name = f"shadowd_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(**kw) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')

    def drop() -> None:
        with psycopg.connect(**kw) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    return u.set(database=name).render_as_string(hide_password=False), drop


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=60, help="batches per client")
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="alternating raw/HTTP rounds; medians reported")
    ap.add_argument("--pg", default=PG_DEFAULT)
    ap.add_argument("--no-pg", action="store_true")
    args = ap.parse_args()
    data = batches(args.batches)
    per = LAYERS * STEPS_PER_BATCH
    lines = []
    targets = [("sqlite", None)] + ([] if args.no_pg else [("postgresql", args.pg)])
    for name, admin in targets:
        raws: dict[str, list[float]] = {"plain": [], "bg": []}
        rates, p50s, p99s, ratios = [], [], [], []
        # alternate raw and HTTP rounds so that both see the same machine load; report medians
        for _ in range(args.rounds):
            with tempfile.TemporaryDirectory() as tmp:
                drops = []
                try:
                    if admin is None:
                        raw_url, http_url = f"sqlite:///{tmp}/raw.db", f"sqlite:///{tmp}/http.db"
                    else:
                        raw_url, d1 = pg_fresh(admin)
                        http_url, d2 = pg_fresh(admin)
                        drops = [d1, d2]
                except Exception as exc:
                    print(f"{name}: skipped ({exc})")
                    break
                try:
                    raws["plain"].append(raw_rate(raw_url, data))
                    best = raws["plain"][-1]
                    if admin is None:
                        raws["bg"].append(raw_rate(f"sqlite:///{tmp}/raw-bg.db", data, background_checkpoint=True))
                        best = max(best, raws["bg"][-1])
                    rate, p50, p99 = http_rate(http_url, data, args.clients)
                    rates.append(rate)
                    ratios.append(rate / best)
                    p50s.append(p50)
                    p99s.append(p99)
                finally:
                    for drop in drops:
                        drop()
        if not rates:
            continue
        rate = float(np.median(rates))
        plain = float(np.median(raws["plain"]))
        bg = float(np.median(raws["bg"])) if raws["bg"] else float("nan")
        raw = max(plain, bg) if raws["bg"] else plain
        how = (f"executemany; autocheckpoint {plain:,.0f}, background checkpoint {bg:,.0f}" if admin is None
               else "COPY FROM STDIN (FORMAT BINARY)")
        lines.append(f"| {name} | {per} | {args.clients} | {rate:,.0f} | {raw:,.0f} | {float(np.median(ratios)):.2f} | "
                     f"{np.median(p50s):.1f} | {np.median(p99s):.1f} | {how} |")
        print(lines[-1], flush=True)
    header = ("| database | samples/batch | clients | HTTP records/s | raw insert rows/s | HTTP/raw | "
              "p50 batch ms | p99 batch ms | raw baseline |\n|---|---|---|---|---|---|---|---|---|")
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    machine = f"{os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}"
    method = ("Raw baseline: the same rows (the collector's own INSERT / COPY statement and data, built before "
              "the clock starts) into the same kind of database (made by `shadowd db upgrade`, the collector's "
              "connection settings), one transaction per batch, one connection; SQLite: the faster of plain "
              "executemany with SQLite's autocheckpoint and with the WAL checkpointed by another process "
              "(the collector's checkpointer, as in the collector); PostgreSQL: binary COPY. "
              f"Medians of {args.rounds} alternating raw/HTTP rounds of {args.batches} batches per client; "
              "HTTP/raw is the median of the per-round ratios.")
    report = (f"\n## {stamp} — commit {commit()}\n\n{machine}\n\n{header}\n" + "\n".join(lines) + "\n\n"
              + method + "\n")
    out = ROOT / "bench" / "results" / f"ingest-{dt.date.today().isoformat()}.md"
    if not out.exists():
        out.write_text("# Ingest throughput (bench/ingest.py)\n\nGoal: ≥ 200 000 records/s into SQLite and ≥ half "
                       "of each database's raw rate, on a 2-core machine.\n")
    append_results(out, report)
    print(header)
    print("\n".join(lines))
    print(f"appended to {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
