"""Producers' pipeline stage: the stages of a pipeline-parallel launch share TP ranks

A producer is known by (stage, rank). Every producer stored before this revision is stage 0.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-07 06:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op


revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('producers', schema=None) as batch_op:
        batch_op.add_column(sa.Column('stage', sa.Integer(), server_default='0', nullable=False))


def downgrade() -> None:
    with op.batch_alter_table('producers', schema=None) as batch_op:
        batch_op.drop_column('stage')
