"""On mode's calls per producer: on a shape bucket the verdict covers, and on one it does not

A producer in on mode serves the candidate only on the shape buckets its promotion gate's verdict covered; the
baseline serves the others. These counters say how much of its traffic each was. Every producer stored before this
revision reports 0.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-07 12:45:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op


revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('producers', schema=None) as batch_op:
        batch_op.add_column(sa.Column('on_covered_calls', sa.BigInteger(), server_default='0', nullable=False))
        batch_op.add_column(sa.Column('on_uncovered_calls', sa.BigInteger(), server_default='0', nullable=False))


def downgrade() -> None:
    with op.batch_alter_table('producers', schema=None) as batch_op:
        batch_op.drop_column('on_uncovered_calls')
        batch_op.drop_column('on_covered_calls')
