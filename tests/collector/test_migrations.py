"""Alembic migrations up and down on both databases, and the CLI around them."""

from __future__ import annotations

import threading

from sqlalchemy import create_engine, inspect
from typer.testing import CliRunner

from shadowd.cli import app as cli
from shadowd.collector import tables as t
from shadowd.collector.db import downgrade, upgrade
from tests.collector.helpers import count_rows, post_msgpack, register
from tests.factories import make_batch, run_body


def _tables(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        return set(inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def test_migrations_up_down_up(db_url):
    expected = set(t.metadata.tables)
    upgrade(db_url)
    assert _tables(db_url) == expected
    downgrade(db_url, "base")
    assert _tables(db_url) == set()
    upgrade(db_url)
    assert _tables(db_url) == expected


def test_migrated_schema_has_every_column_of_the_tables(db_url):
    """What the migrations build is what ``tables`` declares, column for column (not just table names)."""
    upgrade(db_url)
    engine = create_engine(db_url)
    try:
        insp = inspect(engine)
        for table in t.metadata.tables.values():
            assert {c["name"] for c in insp.get_columns(table.name)} == set(table.columns.keys()), table.name
    finally:
        engine.dispose()


def test_cli_db_upgrade_and_serve_refusal(fresh_sqlite):
    runner = CliRunner()
    refused = runner.invoke(cli, ["serve", "--db", fresh_sqlite, "--port", "0"])
    assert refused.exit_code == 3
    assert "shadowd db upgrade" in refused.output
    assert runner.invoke(cli, ["db", "current", "--db", fresh_sqlite]).exit_code == 1
    done = runner.invoke(cli, ["db", "upgrade", "--db", fresh_sqlite])
    assert done.exit_code == 0, done.output
    assert runner.invoke(cli, ["db", "current", "--db", fresh_sqlite]).exit_code == 0


def test_two_collectors_on_one_postgres_lose_nothing(fresh_pg, make_client):
    """Two app instances (two engines) ingest concurrently into the same rollup cells."""
    a = make_client(fresh_pg)
    b = make_client(fresh_pg, auto_upgrade=False)
    run_id = register(a, run_body(num_layers=4))
    errors: list[str] = []

    def feed(client, producer):
        for seq in range(6):
            r = post_msgpack(client, run_id, make_batch(200, producer=producer, seq=seq, step0=seq * 50))
            if r.status_code != 200:
                errors.append(r.text)

    threads = [threading.Thread(target=feed, args=(cl, p)) for cl, p in ((a, "pa"), (b, "pb"))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert count_rows(fresh_pg, t.samples) == 2400
    layers = a.get(f"/v1/runs/{run_id}/layers").json()["layers"]
    assert sum(row["samples"] for row in layers) == 2400
    run = b.get(f"/v1/runs/{run_id}").json()
    assert run["samples"] == 2400 and run["batches"] == 12
