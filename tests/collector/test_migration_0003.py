"""Migration 0003 (narrow samples) up and down with data, on SQLite and the real PostgreSQL."""

from __future__ import annotations

import numpy as np
from sqlalchemy import create_engine, text

from shadowd.collector import histblob
from shadowd.collector.db import downgrade, upgrade
from shadowd.judge.bins import octave_of, stat_bins
from tests.collector.helpers import post_msgpack, sample_rows
from tests.factories import make_batch

OLD_COLUMNS = ("run_id", "producer", "rank", "layer", "step", "call", "ts", "batch_size", "draft_tokens",
               "prefix_len", "heads", "numel", "max_abs", "mean_abs", "max_rel", "rel_l2", "cos_diff", "out_scale",
               "nan_base", "inf_base", "nan_cand", "inf_cand", "cand_nonfinite", "base_nonfinite", "hist", "error",
               "mode", "oracle_cand_err", "oracle_base_err", "cand_us", "base_us", "new_requests", "exceeded")


def _old_rows(run_id: int) -> list[dict]:
    rng = np.random.default_rng(3)
    rows = []
    for i in range(12):
        hist = np.zeros(40, dtype=np.int64)
        hist[[0, 18, 19, 20]] = rng.integers(0, 2**40, 4)
        rows.append({
            "run_id": run_id, "producer": "p-other" if i % 3 == 2 else "p-old", "rank": 0, "layer": i % 4,
            "step": i // 4, "call": i, "ts": 1.8e9 + i, "batch_size": 4, "draft_tokens": 8, "prefix_len": 100,
            "heads": 8, "numel": 4096, "max_abs": 1e-3, "mean_abs": 1e-4, "max_rel": 1e-2, "rel_l2": 2e-3 * (i + 1),
            "cos_diff": 1e-6, "out_scale": 1.0, "nan_base": 0, "inf_base": 0, "nan_cand": i % 2, "inf_cand": 0,
            "cand_nonfinite": 0, "base_nonfinite": 0, "hist": hist.astype("<i8").tobytes(),
            "error": "exception:X" if i == 5 else None, "mode": "validate", "oracle_cand_err": None,
            "oracle_base_err": None, "cand_us": 10.0, "base_us": 20.0, "new_requests": 1, "exceeded": 0,
        })
    return rows


def _rel_hist(rows: list[dict]) -> dict[tuple[int, int], int]:
    out: dict[tuple[int, int], int] = {}
    for r in rows:
        b = int(stat_bins(np.array([r["rel_l2"]]))[0])
        out[(r["layer"], b)] = out.get((r["layer"], b), 0) + 1
    return out


def test_migration_0003_up_and_down_keeps_the_data(db_url, make_client):
    upgrade(db_url, "0002")
    engine = create_engine(db_url)
    with engine.begin() as conn:
        run_id = conn.execute(text(
            "INSERT INTO runs (run_key, model, num_layers, tp_size, candidate_name, candidate_fingerprint, "
            "baseline_name, baseline_fingerprint, labels, started_at, created_at) VALUES "
            "('old', 'kimi-k2.6', 4, 1, 'kdtree-verify', 'build-abc123', 'triton-extend', 'sglang-0.5.23', '{}', 0, 0) "
            "RETURNING id")).scalar_one()
        conn.execute(text("INSERT INTO batches (run_id, producer, seq, digest, n_samples, received_at) "
                          "VALUES (:r, 'p-old', 0, 'abc', 8, 1.9e9)"), {"r": run_id})
        rows = _old_rows(run_id)
        names = ", ".join(f'"{c}"' for c in OLD_COLUMNS)
        conn.execute(text(f"INSERT INTO samples ({names}) VALUES ({', '.join(':' + c for c in OLD_COLUMNS)})"), rows)
        old_hist = _rel_hist(rows)
        conn.execute(text("INSERT INTO rollup_hist (run_id, layer, stat, bin, count) "
                          "VALUES (:r, :l, 'rel_l2', :b, :n)"),
                     [{"r": run_id, "l": layer, "b": b, "n": n} for (layer, b), n in old_hist.items()])
    engine.dispose()

    upgrade(db_url)
    stored = sample_rows(db_url)
    assert len(stored) == 12
    for s, r in zip(stored, rows, strict=True):
        assert (s["run_id"], s["producer"], s["seq"]) == (run_id, r["producer"], -1)
        assert s["hist"] == np.frombuffer(r["hist"], dtype="<i8").tolist()
        assert (s["call"], s["layer"], s["rel_l2"], s["error"], s["nan_cand"]) == (
            r["call"], r["layer"], r["rel_l2"], r["error"], r["nan_cand"])
    engine = create_engine(db_url)
    with engine.connect() as conn:
        blobs = conn.execute(text("SELECT hist FROM samples")).scalars().all()
        batches = conn.execute(text("SELECT producer, seq, n_samples, max_ts FROM batches "
                                    "ORDER BY producer, seq")).all()
        hists = conn.execute(text("SELECT layer, stat, bin, count FROM rollup_hist")).all()
    engine.dispose()
    assert all(len(b) == 1 + 40 * 8 and b[0] == 8 for b in blobs)  # 2^40 counts need 8 bytes
    assert [tuple(b[:3]) for b in batches] == [("p-old", -1, 8), ("p-old", 0, 8), ("p-other", -1, 4)]
    assert batches[0][3] == 1.8e9 + 10  # the newest sample of the legacy batch
    run_wide = {b: n for layer, stat, b, n in hists if layer == -1 and stat == "rel_l2"}
    octave = {(layer, b): n for layer, stat, b, n in hists if stat == "rel_l2:oct"}
    want_wide: dict[int, int] = {}
    want_oct: dict[tuple[int, int], int] = {}
    for (layer, b), n in old_hist.items():
        want_wide[b] = want_wide.get(b, 0) + n
        key = (layer, int(octave_of(np.array([b]))[0]))
        want_oct[key] = want_oct.get(key, 0) + n
    assert run_wide == want_wide and octave == want_oct
    assert not [h for h in hists if h[1] == "rel_l2" and h[0] >= 0]

    # the upgraded database takes new batches; the old samples stay readable beside them
    c = make_client(db_url, auto_upgrade=False)
    assert post_msgpack(c, run_id, make_batch(8, seq=1, producer="p-old", packed=True)).status_code == 200
    assert c.get(f"/v1/runs/{run_id}/producers").json()[0]["max_seq"] == 1
    assert len(sample_rows(db_url)) == 20
    c.close()

    downgrade(db_url, "0002")
    engine = create_engine(db_url)
    with engine.connect() as conn:
        back = [dict(r) for r in conn.execute(text(f"SELECT {', '.join(OLD_COLUMNS)} FROM samples ORDER BY id"))
                .mappings()]
        batches = conn.execute(text("SELECT producer, seq FROM batches ORDER BY producer, seq")).all()
        hists = conn.execute(text("SELECT layer, stat, bin, count FROM rollup_hist WHERE stat = 'rel_l2'")).all()
    engine.dispose()
    assert len(back) == 20
    for b, r in zip(back[:12], rows, strict=True):
        assert {k: (bytes(v) if k == "hist" else v) for k, v in b.items()} == {
            k: (float(v) if isinstance(v, float) else v) for k, v in r.items()}
    assert all(len(b["hist"]) == 320 for b in back) and back[12]["producer"] == "p-old"
    assert [tuple(b) for b in batches] == [("p-old", 0), ("p-old", 1)]
    # per-layer quarter-octave histograms again: same totals per layer, each count in its octave's top bin
    per_layer: dict[int, int] = {}
    for layer, _, b, n in hists:
        assert b % 4 == 3 and layer >= 0
        per_layer[layer] = per_layer.get(layer, 0) + n
    assert per_layer == {layer: 3 + 2 for layer in range(4)}  # 12 old samples + 8 new over 4 layers

    # upgraded again, retention deletes exactly the legacy batch that is old enough: the two legacy
    # batches' rowid ranges overlap (their samples were interleaved), so rows go by batch, not by range
    upgrade(db_url)
    c = make_client(db_url, auto_upgrade=False)
    assert c.app.state.shadowd.store.prune_samples(1.8e9 + 10.5) == 16  # p-old: 8 old + 8 new samples
    left = sample_rows(db_url)
    assert [r["call"] for r in left] == [2, 5, 8, 11] and {r["producer"] for r in left} == {"p-other"}


def test_stored_histograms_decode_both_forms():
    counts = [0, 3, 70000, 0, *range(36)]
    rows = histblob.encode_rows(np.array([counts, [0] * 40]))
    assert rows.shape == (2, 1 + 40 * 4) and rows[1, 0] == 4  # one width for the whole batch
    assert histblob.decode(rows[0].tobytes()) == counts
    assert histblob.decode(np.array(counts, dtype="<i8").tobytes()) == counts
    assert histblob.decode(histblob.encode_rows(np.array([[255] * 40]))[0].tobytes()) == [255] * 40
