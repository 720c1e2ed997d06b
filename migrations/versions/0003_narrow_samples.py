"""Narrow raw samples: run and producer on the batch row, compact histograms, defaults for counts

* ``batches`` gets a surrogate key ``id`` (the claim stays unique on run, producer, seq),
  ``max_ts``, the newest sample time of the batch (retention deletes a batch's samples once it is
  older than the window), and on SQLite ``first_id``/``last_id``, the rowid range of its samples.
* ``samples`` loses the index on ``ts`` (retention goes by batch): no secondary index on SQLite
  (rowid ranges), an index on ``batch_id`` on PostgreSQL.
* ``samples`` references its batch (``batch_id``) instead of carrying ``run_id`` and ``producer``
  on every row. Samples stored before this revision are attached to one batch row per (run,
  producer) with ``seq = -1`` and digest ``legacy``.
* ``samples.hist`` is stored as one width byte and HIST_BINS little-endian counts of that width
  (shadowd.collector.histblob) instead of HIST_BINS int64 (320 bytes); existing rows are rewritten.
* count columns of ``samples`` default to 0, so that a batch's insert may leave them out.
* PostgreSQL: the tables every batch updates (runs, producers, the rollups) get fillfactor 50, so
  that their updates stay on the page (HOT, no index entry per update).
* ``rollup_hist``: the quarter-octave histograms of max_abs, rel_l2, cos_diff and scaled are kept
  run-wide (layer -1) and per layer in octave bins (stat ``<name>:oct``) — a quarter of the rows per
  batch; the oracle ratio stays per layer in quarter-octave bins. Existing rows are converted
  exactly. The downgrade cannot split run-wide bins by layer again: it puts each per-layer octave
  count in the octave's top quarter-octave bin (upper bounds stay conservative; the metric buckets,
  at octave edges, stay exact).

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29 23:10:00
"""

from __future__ import annotations

import numpy as np
import sqlalchemy as sa
from alembic import op


revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None

BINS = 40  # shadowd.wire.HIST_BINS when this revision was written
LEGACY = BINS * 8
COUNTS = ('nan_base', 'inf_base', 'nan_cand', 'inf_cand', 'cand_nonfinite', 'base_nonfinite')
# samples columns other than id, run_id/batch_id, producer (in the order of revision 0001)
REST = ('rank', 'layer', 'step', 'call', 'ts', 'batch_size', 'draft_tokens', 'prefix_len', 'heads', 'numel',
        'max_abs', 'mean_abs', 'max_rel', 'rel_l2', 'cos_diff', 'out_scale', *COUNTS, 'hist', 'error', 'mode',
        'oracle_cand_err', 'oracle_base_err', 'cand_us', 'base_us', 'new_requests', 'exceeded')
BigId = sa.BigInteger().with_variant(sa.Integer(), 'sqlite')
HOT_TABLES = ('runs', 'producers', 'rollup_cells', 'rollup_time', 'rollup_hist', 'rollup_steps')


def _compact(blob: bytes) -> bytes:
    counts = np.frombuffer(blob, dtype='<i8')
    top = int(counts.max()) if counts.size else 0
    w = next((w for w in (1, 2, 4) if top < 1 << (8 * w)), 8)
    return bytes([w]) + counts.astype(f'<u{w}').tobytes()


def _legacy(blob: bytes) -> bytes:
    if len(blob) == LEGACY:
        return blob
    return np.frombuffer(blob, dtype=f'<u{blob[0]}', offset=1).astype('<i8').tobytes()


def _rewrite_hists(convert) -> None:
    conn = op.get_bind()
    last = -1
    while True:
        rows = conn.execute(sa.text('SELECT id, hist FROM samples WHERE id > :last ORDER BY id LIMIT 5000'),
                            {'last': last}).all()
        if not rows:
            return
        conn.execute(sa.text('UPDATE samples SET hist = :h WHERE id = :id'),
                     [{'h': convert(bytes(h)), 'id': i} for i, h in rows])
        last = rows[-1][0]


STATS = "('max_abs', 'rel_l2', 'cos_diff', 'scaled')"
OCT = ("CASE WHEN bin IN (-1000, 1000) THEN bin WHEN bin >= 0 THEN bin / 4 ELSE -((3 - bin) / 4) END")


def _hists_up() -> None:
    op.execute('INSERT INTO rollup_hist (run_id, layer, stat, bin, count) '
               f'SELECT run_id, -1, stat, bin, SUM(count) FROM rollup_hist WHERE layer >= 0 AND stat IN {STATS} '
               'GROUP BY run_id, stat, bin')
    op.execute('INSERT INTO rollup_hist (run_id, layer, stat, bin, count) '
               f"SELECT run_id, layer, stat || '\\:oct', {OCT}, SUM(count) FROM rollup_hist "
               f'WHERE layer >= 0 AND stat IN {STATS} GROUP BY run_id, layer, stat, {OCT}')
    op.execute(f'DELETE FROM rollup_hist WHERE layer >= 0 AND stat IN {STATS}')


def _hists_down() -> None:
    op.execute('INSERT INTO rollup_hist (run_id, layer, stat, bin, count) '
               "SELECT run_id, layer, substr(stat, 1, length(stat) - 4), "
               "CASE WHEN bin IN (-1000, 1000) THEN bin WHEN bin >= 10 THEN 40 ELSE 4 * bin + 3 END, count "
               "FROM rollup_hist "
               "WHERE layer >= 0 AND stat LIKE '%\\:oct'")
    op.execute("DELETE FROM rollup_hist WHERE layer < 0 OR stat LIKE '%\\:oct'")


def _new_batches(name: str) -> None:
    op.create_table(name,
    sa.Column('id', BigId, autoincrement=True, nullable=False),
    sa.Column('run_id', sa.BigInteger(), nullable=False),
    sa.Column('producer', sa.String(length=64), nullable=False),
    sa.Column('seq', sa.BigInteger(), nullable=False),
    sa.Column('digest', sa.String(length=64), nullable=False),
    sa.Column('n_samples', sa.Integer(), nullable=False),
    sa.Column('received_at', sa.Float(), nullable=False),
    sa.Column('max_ts', sa.Float(), nullable=False),
    sa.Column('first_id', sa.BigInteger(), nullable=True),
    sa.Column('last_id', sa.BigInteger(), nullable=True),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('run_id', 'producer', 'seq', name='uq_batches_run_producer_seq'),
    )


def _samples_columns(head: list[sa.Column]) -> list[sa.Column]:
    counts = {c: sa.Column(c, sa.BigInteger(), server_default='0', nullable=False) for c in COUNTS}
    return [
        sa.Column('id', BigId, autoincrement=True, nullable=False),
        *head,
        sa.Column('rank', sa.Integer(), nullable=False),
        sa.Column('layer', sa.Integer(), nullable=False),
        sa.Column('step', sa.BigInteger(), nullable=False),
        sa.Column('call', sa.BigInteger(), nullable=False),
        sa.Column('ts', sa.Float(), nullable=False),
        sa.Column('batch_size', sa.Integer(), nullable=False),
        sa.Column('draft_tokens', sa.Integer(), nullable=False),
        sa.Column('prefix_len', sa.Integer(), nullable=False),
        sa.Column('heads', sa.Integer(), nullable=False),
        sa.Column('numel', sa.BigInteger(), nullable=False),
        *(sa.Column(c, sa.Float(), nullable=True) for c in ('max_abs', 'mean_abs', 'max_rel', 'rel_l2', 'cos_diff',
                                                             'out_scale')),
        *counts.values(),
        sa.Column('hist', sa.LargeBinary(), nullable=False),
        sa.Column('error', sa.String(length=200), nullable=True),
        sa.Column('mode', sa.String(length=16), nullable=True),
        *(sa.Column(c, sa.Float(), nullable=True) for c in ('oracle_cand_err', 'oracle_base_err', 'cand_us',
                                                             'base_us')),
        sa.Column('new_requests', sa.Integer(), server_default='0', nullable=True),
        sa.Column('exceeded', sa.Integer(), server_default='0', nullable=False),
        sa.PrimaryKeyConstraint('id'),
    ]


def _legacy_batches() -> None:
    op.execute("INSERT INTO batches (run_id, producer, seq, digest, n_samples, received_at, max_ts) "
               "SELECT run_id, producer, -1, 'legacy', count(*), max(ts), max(ts) FROM samples "
               "GROUP BY run_id, producer")


def upgrade() -> None:
    rest = ', '.join(f'"{c}"' for c in REST)
    if op.get_context().dialect.name == 'postgresql':
        op.execute('ALTER TABLE batches DROP CONSTRAINT batches_pkey')
        op.execute('ALTER TABLE batches ADD COLUMN id BIGSERIAL PRIMARY KEY')
        op.add_column('batches', sa.Column('max_ts', sa.Float(), nullable=True))
        op.execute('UPDATE batches SET max_ts = received_at')
        op.alter_column('batches', 'max_ts', nullable=False)
        op.create_unique_constraint('uq_batches_run_producer_seq', 'batches', ['run_id', 'producer', 'seq'])
        op.add_column('batches', sa.Column('first_id', sa.BigInteger(), nullable=True))
        op.add_column('batches', sa.Column('last_id', sa.BigInteger(), nullable=True))
        _legacy_batches()
        op.add_column('samples', sa.Column('batch_id', sa.BigInteger(), nullable=True))
        op.execute('UPDATE samples s SET batch_id = b.id FROM batches b '
                   'WHERE b.seq = -1 AND b.run_id = s.run_id AND b.producer = s.producer')
        op.alter_column('samples', 'batch_id', nullable=False)
        op.drop_column('samples', 'run_id')
        op.drop_column('samples', 'producer')
        for c in (*COUNTS, 'new_requests', 'exceeded'):
            op.alter_column('samples', c, server_default='0')
        op.drop_index('ix_samples_ts', table_name='samples')
        op.create_index('ix_samples_batch', 'samples', ['batch_id'], unique=False)
        for table in HOT_TABLES:
            op.execute(f'ALTER TABLE {table} SET (fillfactor = 50)')
    else:
        _new_batches('batches_new')
        op.execute('INSERT INTO batches_new (run_id, producer, seq, digest, n_samples, received_at, max_ts) '
                   'SELECT run_id, producer, seq, digest, n_samples, received_at, received_at FROM batches')
        op.drop_table('batches')
        op.rename_table('batches_new', 'batches')
        _legacy_batches()
        op.drop_index('ix_samples_ts', table_name='samples')
        op.rename_table('samples', 'samples_old')
        op.create_table('samples', *_samples_columns([sa.Column('batch_id', sa.BigInteger(), nullable=False)]))
        op.execute(f'INSERT INTO samples (id, batch_id, {rest}) SELECT s.id, b.id, {", ".join(f"s.{c}" for c in REST)} '
                   'FROM samples_old s JOIN batches b ON b.seq = -1 AND b.run_id = s.run_id AND b.producer = s.producer')
        op.drop_table('samples_old')
        op.execute('UPDATE batches SET first_id = (SELECT MIN(id) FROM samples WHERE batch_id = batches.id), '
                   'last_id = (SELECT MAX(id) FROM samples WHERE batch_id = batches.id) WHERE seq = -1')
    _rewrite_hists(_compact)
    _hists_up()


def downgrade() -> None:
    rest = ', '.join(f'"{c}"' for c in REST)
    _hists_down()
    _rewrite_hists(_legacy)
    if op.get_context().dialect.name == 'postgresql':
        for table in HOT_TABLES:
            op.execute(f'ALTER TABLE {table} RESET (fillfactor)')
        op.add_column('samples', sa.Column('run_id', sa.BigInteger(), nullable=True))
        op.add_column('samples', sa.Column('producer', sa.String(length=64), nullable=True))
        op.execute('UPDATE samples s SET run_id = b.run_id, producer = b.producer FROM batches b '
                   'WHERE b.id = s.batch_id')
        op.execute('DELETE FROM samples WHERE run_id IS NULL')
        op.alter_column('samples', 'run_id', nullable=False)
        op.alter_column('samples', 'producer', nullable=False)
        op.create_foreign_key('samples_run_id_fkey', 'samples', 'runs', ['run_id'], ['id'], ondelete='CASCADE')
        op.drop_index('ix_samples_batch', table_name='samples')
        op.drop_column('samples', 'batch_id')
        op.create_index('ix_samples_ts', 'samples', ['ts'], unique=False)
        for c in (*COUNTS, 'exceeded'):
            op.alter_column('samples', c, server_default=None)
        op.alter_column('samples', 'new_requests', server_default=None)
        op.execute('DELETE FROM batches WHERE seq < 0')
        op.drop_constraint('uq_batches_run_producer_seq', 'batches', type_='unique')
        op.drop_column('batches', 'id')
        op.drop_column('batches', 'max_ts')
        op.drop_column('batches', 'first_id')
        op.drop_column('batches', 'last_id')
        op.create_primary_key('batches_pkey', 'batches', ['run_id', 'producer', 'seq'])
        return
    op.rename_table('samples', 'samples_new')
    columns = _samples_columns([
        sa.Column('run_id', sa.BigInteger(), nullable=False),
        sa.Column('producer', sa.String(length=64), nullable=False),
    ])
    for col in columns:
        if col.name in (*COUNTS, 'new_requests', 'exceeded'):
            col.server_default = None
    op.create_table('samples', *columns, sa.ForeignKeyConstraint(['run_id'], ['runs.id'], ondelete='CASCADE'))
    op.execute(f'INSERT INTO samples (id, run_id, producer, {rest}) '
               f'SELECT s.id, b.run_id, b.producer, {", ".join(f"s.{c}" for c in REST)} '
               'FROM samples_new s JOIN batches b ON b.id = s.batch_id')
    op.drop_table('samples_new')
    op.create_index('ix_samples_ts', 'samples', ['ts'], unique=False)
    op.create_table('batches_old',
    sa.Column('run_id', sa.BigInteger(), nullable=False),
    sa.Column('producer', sa.String(length=64), nullable=False),
    sa.Column('seq', sa.BigInteger(), nullable=False),
    sa.Column('digest', sa.String(length=64), nullable=False),
    sa.Column('n_samples', sa.Integer(), nullable=False),
    sa.Column('received_at', sa.Float(), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('run_id', 'producer', 'seq'),
    sqlite_with_rowid=False
    )
    op.execute('INSERT INTO batches_old (run_id, producer, seq, digest, n_samples, received_at) '
               'SELECT run_id, producer, seq, digest, n_samples, received_at FROM batches WHERE seq >= 0')
    op.drop_table('batches')
    op.rename_table('batches_old', 'batches')
