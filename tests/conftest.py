"""Shared fixtures: databases (SQLite file and the real PostgreSQL) and collector clients."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

PG_URL = os.environ.get("SHADOWD_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _pg_admin_url() -> str:
    return PG_URL


def _pg_reachable() -> str | None:
    try:
        import psycopg
    except ImportError:
        return "psycopg is not installed (pip install '.[postgres]')"
    from sqlalchemy.engine import make_url

    u = make_url(_pg_admin_url())
    try:
        with psycopg.connect(host=u.host, port=u.port or 5432, user=u.username, password=u.password,
                             dbname=u.database, connect_timeout=3):
            return None
    except Exception as exc:
        return f"PostgreSQL at {u.host}:{u.port} unreachable: {exc}"


@pytest.fixture(scope="session")
def pg_available() -> None:
    why = _pg_reachable()
    if why is not None:
        if IN_CI:
            pytest.fail(f"CI must run the PostgreSQL tests: {why}")
        pytest.skip(why)


@pytest.fixture
def fresh_pg(pg_available: None) -> Iterator[str]:
    """A new, empty PostgreSQL database for one test; dropped afterwards."""
    import psycopg
    from sqlalchemy.engine import make_url

    u = make_url(_pg_admin_url())
    name = f"shadowd_t_{uuid.uuid4().hex[:10]}"
    kw = {"host": u.host, "port": u.port or 5432, "user": u.username, "password": u.password,
          "dbname": u.database, "autocommit": True}
    with psycopg.connect(**kw) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield u.set(database=name).render_as_string(hide_password=False)
    with psycopg.connect(**kw) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def fresh_sqlite(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'shadowd.db'}"


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Each test using this runs against SQLite and against the real PostgreSQL."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'shadowd.db'}"
    return str(request.getfixturevalue("fresh_pg"))


@pytest.fixture
def make_client() -> Iterator[Callable[..., object]]:
    """Build a TestClient over a fresh app (with its own registry); closed at teardown."""
    from fastapi.testclient import TestClient
    from prometheus_client import CollectorRegistry

    from shadowd.collector.app import create_app
    from shadowd.collector.settings import CollectorSettings

    made: list[TestClient] = []

    def build(db_url: str, **settings: object) -> TestClient:
        settings.setdefault("auto_upgrade", True)
        app = create_app(CollectorSettings(db_url=db_url, **settings), registry=CollectorRegistry())
        client = TestClient(app)
        client.__enter__()
        made.append(client)
        return client

    yield build
    for c in made:
        c.__exit__(None, None, None)
