"""Engine creation and schema-version checks (SQLite in WAL mode, or PostgreSQL)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url

__all__ = ["SchemaOutdated", "alembic_config", "check_schema", "downgrade", "make_engine", "upgrade"]


class SchemaOutdated(RuntimeError):
    """The database schema is not at the code's migration head."""


def make_engine(url: str) -> Engine:
    """An engine for ``url``. SQLite gets WAL, a busy timeout and BEGIN IMMEDIATE writes."""
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _on_connect(dbapi_conn: Any, _record: Any) -> None:
            dbapi_conn.isolation_level = None  # we emit BEGIN ourselves
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        @event.listens_for(engine, "begin")
        def _on_begin(conn: Any) -> None:
            conn.exec_driver_sql("BEGIN IMMEDIATE")

        return engine
    return create_engine(url, pool_pre_ping=True, pool_size=8, max_overflow=8)


def _script_location() -> str:
    return str(Path(str(resources.files("shadowd_migrations"))))


def alembic_config(url: str) -> Config:
    """Alembic configuration pointing at the shipped migrations and ``url``."""
    cfg = Config()
    cfg.set_main_option("script_location", _script_location())
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    """Apply migrations up to ``revision``."""
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str) -> None:
    """Revert migrations down to ``revision`` (``base`` drops everything)."""
    command.downgrade(alembic_config(url), revision)


def check_schema(engine: Engine, url: str) -> str:
    """The database's revision, which is the migrations' head; else raise SchemaOutdated."""
    head = ScriptDirectory.from_config(alembic_config(url)).get_current_head()
    with engine.connect() as conn:
        current = MigrationContext.configure(conn).get_current_revision()
    if current != head:
        state = "has no shadowd schema" if current is None else f"is at revision {current}"
        shown = make_url(url).render_as_string(hide_password=True)
        raise SchemaOutdated(
            f"the database {state}, the code needs {head}: run `shadowd db upgrade --db {shown}` "
            "(or start with `shadowd serve --upgrade`)"
        )
    return str(current)
