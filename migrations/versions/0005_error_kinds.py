"""Candidate errors per kind (rollup_errors)

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30 19:45:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op


revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'rollup_errors',
        sa.Column('run_id', sa.BigInteger(), nullable=False),
        sa.Column('error', sa.String(length=200), nullable=False),
        sa.Column('n', sa.BigInteger(), server_default='0', nullable=False),
        sa.Column('first_ts', sa.Float(), nullable=False),
        sa.Column('last_ts', sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(['run_id'], ['runs.id'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('run_id', 'error'),
        sqlite_with_rowid=False,
    )


def downgrade() -> None:
    op.drop_table('rollup_errors')
