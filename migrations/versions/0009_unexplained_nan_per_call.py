"""Calls with non-finite statistics that nothing of their own explains, counted per call

The tolerance criterion fails a cell whose calls have NaN / Inf statistics with no non-finite output and no
candidate error to explain them. It subtracted the cell's explained calls from its NaN-statistic calls, so a
baseline event elsewhere in the cell (finite statistics, a non-finite baseline value) could hide another call's
unexplained NaN and let a run go READY. The rollups now count such calls one by one. Rows stored before this
revision keep the old judgement (their NaN-statistic calls less their explained ones, at least 0): the counts
per call cannot be recovered from them.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-07 20:05:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op


revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None

_TABLES = ('rollup_cells', 'rollup_time')


def upgrade() -> None:
    for table in _TABLES:
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.add_column(sa.Column('n_nan_unexplained', sa.BigInteger(), server_default='0', nullable=False))
        op.execute(f"UPDATE {table} SET n_nan_unexplained = CASE WHEN n_nan_stat - n_base_nonfinite - n_cand_nonfinite"
                   f" - n_error > 0 THEN n_nan_stat - n_base_nonfinite - n_cand_nonfinite - n_error ELSE 0 END")


def downgrade() -> None:
    for table in _TABLES:
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_column('n_nan_unexplained')
