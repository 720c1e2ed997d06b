"""Samples a producer gave up, per producer

A producer leaves out of its batch a sample the collector would refuse (a caller's bad bucket or layer), and gives
up a batch the collector refused; until now it only counted them itself. The count now travels with its figures,
so a rank that loses samples this way is seen (metric, alert). Every producer stored before this revision reports 0.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-07 21:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op


revision = '0010'
down_revision = '0009'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('producers', schema=None) as batch_op:
        batch_op.add_column(sa.Column('rejected', sa.BigInteger(), server_default='0', nullable=False))


def downgrade() -> None:
    with op.batch_alter_table('producers', schema=None) as batch_op:
        batch_op.drop_column('rejected')
