"""Speculative-decoding counters per producer and mode (accept length of off / validate / on)

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29 21:24:13.920685
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op


revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('producers', schema=None) as batch_op:
        batch_op.add_column(sa.Column('spec_accept_tokens_off', sa.BigInteger(), server_default='0', nullable=False))
        batch_op.add_column(sa.Column('spec_req_steps_off', sa.BigInteger(), server_default='0', nullable=False))
        batch_op.add_column(sa.Column('spec_passes_off', sa.BigInteger(), server_default='0', nullable=False))
        batch_op.add_column(sa.Column('spec_accept_tokens_validate', sa.BigInteger(), server_default='0', nullable=False))
        batch_op.add_column(sa.Column('spec_req_steps_validate', sa.BigInteger(), server_default='0', nullable=False))
        batch_op.add_column(sa.Column('spec_passes_validate', sa.BigInteger(), server_default='0', nullable=False))
        batch_op.add_column(sa.Column('spec_accept_tokens_on', sa.BigInteger(), server_default='0', nullable=False))
        batch_op.add_column(sa.Column('spec_req_steps_on', sa.BigInteger(), server_default='0', nullable=False))
        batch_op.add_column(sa.Column('spec_passes_on', sa.BigInteger(), server_default='0', nullable=False))


def downgrade() -> None:
    with op.batch_alter_table('producers', schema=None) as batch_op:
        batch_op.drop_column('spec_passes_on')
        batch_op.drop_column('spec_req_steps_on')
        batch_op.drop_column('spec_accept_tokens_on')
        batch_op.drop_column('spec_passes_validate')
        batch_op.drop_column('spec_req_steps_validate')
        batch_op.drop_column('spec_accept_tokens_validate')
        batch_op.drop_column('spec_passes_off')
        batch_op.drop_column('spec_req_steps_off')
        batch_op.drop_column('spec_accept_tokens_off')
