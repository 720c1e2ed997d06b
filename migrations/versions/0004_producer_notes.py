"""Producer notes: why a producer's candidate was disabled or its on mode fell back

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30 19:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op


revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('producers', schema=None) as batch_op:
        batch_op.add_column(sa.Column('disabled_reason', sa.String(length=300), nullable=True))
        batch_op.add_column(sa.Column('fallback_reason', sa.String(length=300), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('producers', schema=None) as batch_op:
        batch_op.drop_column('fallback_reason')
        batch_op.drop_column('disabled_reason')
