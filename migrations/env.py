"""Alembic environment: migrations run against the URL that shadowd passes in its Config."""

from __future__ import annotations

from alembic import context
from sqlalchemy import engine_from_config, pool

from shadowd.collector.tables import metadata

config = context.config
target_metadata = metadata


def run_offline() -> None:
    context.configure(url=config.get_main_option("sqlalchemy.url"), target_metadata=target_metadata,
                      literal_binds=True, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    connectable = engine_from_config(config.get_section(config.config_ini_section, {}),
                                     prefix="sqlalchemy.", poolclass=pool.NullPool)
    with connectable.connect() as connection:
        if connection.dialect.name == "sqlite":
            # 16 KiB pages for a new database (no effect on an existing one): a batch's insert writes
            # far fewer WAL frames than with 4 KiB pages
            connection.exec_driver_sql("PRAGMA page_size = 16384")
            connection.commit()
        context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True)
        with context.begin_transaction():
            context.run_migrations()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
