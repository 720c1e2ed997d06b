"""Compared samples per (TP rank, layer): rollup_ranks

Coverage needs every rank of a run. The table is filled from what is stored: for a run of one rank
from its rollup cells (every sample is rank 0's), for a run of several ranks from the raw samples still
kept (a rank whose raw samples retention already deleted counts again from its next samples).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01 06:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op


revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None

# a sample compared something unless its numel is 0 with no candidate error and no candidate non-finite output
_COMPARED = "(s.numel > 0 OR s.error IS NOT NULL OR s.cand_nonfinite > 0)"


def upgrade() -> None:
    op.create_table(
        'rollup_ranks',
        sa.Column('run_id', sa.BigInteger(), nullable=False),
        sa.Column('rank', sa.Integer(), nullable=False),
        sa.Column('layer', sa.Integer(), nullable=False),
        sa.Column('n', sa.BigInteger(), server_default='0', nullable=False),
        sa.Column('n_empty', sa.BigInteger(), server_default='0', nullable=False),
        sa.Column('first_ts', sa.Float(), nullable=False),
        sa.Column('last_ts', sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(['run_id'], ['runs.id'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('run_id', 'rank', 'layer'),
        sqlite_with_rowid=False,
        postgresql_with={'fillfactor': 50},
    )
    op.execute(
        "INSERT INTO rollup_ranks (run_id, rank, layer, n, n_empty, first_ts, last_ts) "
        "SELECT c.run_id, 0, c.layer, SUM(c.n), 0, MIN(c.first_ts), MAX(c.last_ts) "
        "FROM rollup_cells c JOIN runs r ON r.id = c.run_id WHERE r.tp_size = 1 GROUP BY c.run_id, c.layer"
    )
    op.execute(
        "INSERT INTO rollup_ranks (run_id, rank, layer, n, n_empty, first_ts, last_ts) "
        f"SELECT b.run_id, s.rank, s.layer, SUM(CASE WHEN {_COMPARED} THEN 1 ELSE 0 END), "
        f"SUM(CASE WHEN {_COMPARED} THEN 0 ELSE 1 END), MIN(s.ts), MAX(s.ts) "
        "FROM samples s JOIN batches b ON b.id = s.batch_id JOIN runs r ON r.id = b.run_id "
        "WHERE r.tp_size > 1 GROUP BY b.run_id, s.rank, s.layer"
    )


def downgrade() -> None:
    op.drop_table('rollup_ranks')
