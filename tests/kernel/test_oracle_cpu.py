"""CPU tests: oracle semantics vs a naive float64 loop, NaN containment, metadata, reference."""

from __future__ import annotations

import math

import pytest
import torch
from mla_tree_verify import oracle, reference, testing


def naive(case: testing.Case) -> torch.Tensor:
    """Per (token, head) loop in float64 over an explicit list of visible KV rows."""
    q = case.q.double()
    kv = case.kv_buffer.reshape(-1, 576).double()
    kd = case.k_draft.reshape(-1, 576).double()
    qo, kvp = case.qo_indptr.tolist(), case.kv_indptr.tolist()
    out = torch.zeros(q.shape[0], q.shape[1], 512, dtype=torch.float64)
    for b in range(len(qo) - 1):
        T, L = qo[b + 1] - qo[b], kvp[b + 1] - kvp[b]
        for i in range(T):
            rows = [kv[int(case.kv_indices[kvp[b] + j])] for j in range(L)]
            for j in range(T):
                if case.custom_mask is None:
                    seen = j <= i
                else:
                    seen = bool(case.custom_mask[int(case.mask_indptr[b]) + i * (L + T) + L + j])
                if seen:
                    rows.append(kd[qo[b] + j])
            K = torch.stack(rows)
            for h in range(q.shape[1]):
                s = (K @ q[qo[b] + i, h]) * case.sm_scale
                p = torch.softmax(s, 0)
                out[qo[b] + i, h] = p @ K[:, :512]
    return out


@pytest.mark.parametrize(
    "prefix,sizes,heads,kind,mask",
    [
        ([6, 3], [5, 4], 2, "random", True),
        ([0], [6], 3, "chain", True),
        ([4, 0, 2], [1, 3, 1], 2, "star", True),
        ([5], [7], 2, "random", False),
        ([0, 7], [4, 1], 1, "random", False),
        ([1], [1], 4, "random", True),
    ],
)
def test_oracle_matches_naive_loop(prefix, sizes, heads, kind, mask):
    c = testing.make_case(prefix, sizes, heads, seed=3, tree_kind=kind, use_mask=mask, logit_std=3.0)
    ref = naive(c)
    got = oracle.attention(*c.args())
    assert torch.allclose(got, ref, rtol=1e-10, atol=1e-12)


def test_oracle_chunking_invariant():
    c = testing.make_case([300, 41], [9, 5], 3, seed=5, logit_std=8.0)
    a = oracle.attention(*c.args(), chunk=7)
    b = oracle.attention(*c.args(), chunk=100000)
    assert torch.allclose(a, b, rtol=1e-12, atol=1e-13)


def test_oracle_lse():
    c = testing.make_case([20], [4], 2, seed=6, tree_kind="chain")
    _, lse = oracle.attention(*c.args(), return_lse=True)
    q = c.q.double()[0, 0] * c.sm_scale
    kv = c.kv_buffer.reshape(-1, 576).double()[c.kv_indices]
    s = torch.cat([kv @ q, (c.k_draft.reshape(-1, 576).double()[:1] @ q)])
    assert math.isclose(lse[0, 0].item(), torch.logsumexp(s, 0).item(), rel_tol=1e-12)


def _leaf_and_other(parents):
    children = set(p for p in parents if p >= 0)
    leaves = [i for i in range(len(parents)) if i not in children and i > 0]
    return leaves[0]


def test_nan_in_invisible_draft_row_stays_contained():
    c = testing.make_case([10], [8], 2, seed=7, tree_kind="random")
    leaf = _leaf_and_other(c.trees[0])
    c.k_draft[leaf] = float("nan")
    out = oracle.attention(*c.args())
    vis = testing.ancestor_matrix(c.trees[0])
    for t in range(8):
        sees = bool(vis[t, leaf])
        assert torch.isnan(out[t]).all().item() == sees
        assert torch.isfinite(out[t]).all().item() == (not sees)


def test_nan_v_only_in_invisible_row():
    """NaN in one V element (first 512 columns, so also in k) of a leaf: only the leaf's row is NaN."""
    c = testing.make_case([3], [6], 1, seed=8, tree_kind="star")
    c.k_draft[5, 0, 17] = float("nan")
    out = oracle.attention(*c.args())
    assert torch.isfinite(out[:5]).all()
    assert torch.isnan(out[5]).all()
    ref = reference.attention(*c.args())
    assert torch.equal(torch.isfinite(ref), torch.isfinite(out))


def test_nan_in_prefix_row_reaches_everyone():
    c = testing.make_case([12], [5], 2, seed=9)
    c.kv_buffer[int(c.kv_indices[4])] = float("nan")
    out = oracle.attention(*c.args())
    assert torch.isnan(out).all()


def test_metadata_builder():
    g = torch.Generator().manual_seed(0)
    trees = [[-1, 0, 0, 1], [-1]]
    meta = testing.build_metadata([3, 0], trees, num_slots=10, gen=g)
    assert meta["qo_indptr"].tolist() == [0, 4, 5]
    assert meta["kv_indptr"].tolist() == [0, 3, 3]
    assert meta["qo_indptr"].dtype == torch.int32 and meta["kv_indptr"].dtype == torch.int32
    assert meta["kv_indices"].dtype == torch.int64 and meta["mask_indptr"].dtype == torch.int64
    idx = meta["kv_indices"].tolist()
    assert len(set(idx)) == 3 and all(1 <= i < 10 for i in idx)
    assert meta["mask_indptr"].tolist() == [0, 4 * 7, 4 * 7 + 1]
    m = meta["custom_mask"][:28].reshape(4, 7)
    assert m[:, :3].all()  # prefix columns pre-filled True
    expect = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    assert torch.equal(m[:, 3:], expect)
    assert meta["custom_mask"][28].item() is True
    u8 = testing.build_metadata([3, 0], trees, num_slots=10, gen=g, mask_dtype=torch.uint8)
    assert u8["custom_mask"].dtype == torch.uint8


def test_trees():
    g = torch.Generator().manual_seed(1)
    for kind in ("random", "chain", "star", "wide"):
        for T in (1, 2, 13, 257):
            p = testing.random_tree(T, kind, g)
            assert len(p) == T and p[0] == -1 and all(0 <= p[i] < i for i in range(1, T))
    vis = testing.ancestor_matrix(testing.random_tree(257, "chain"))
    assert torch.equal(vis, torch.ones(257, 257, dtype=torch.bool).tril())


def test_reference_is_close_but_different():
    c = testing.make_case([200, 0], [17, 3], 4, seed=11, logit_std=6.0)
    o = oracle.attention(*c.args())
    r = reference.attention(*c.args())
    ok, info = testing.pass_rule(r, o)
    assert ok, info
    assert info["cand_max_abs"] > 0  # real rounding differences, not a copy


def test_random_specs_cover_edges():
    specs = testing.random_case_specs(0, 60)
    assert any(0 in s["prefix_lens"] for s in specs) and any(1 in s["prefix_lens"] for s in specs)
    assert any(257 in s["tree_sizes"] for s in specs) and any(1 in s["tree_sizes"] for s in specs)
    assert any(not s["use_mask"] for s in specs)


def test_pass_rule_flags_nonfinite_mismatch():
    o = torch.ones(2, 2, 512, dtype=torch.float64)
    c = o.clone().to(torch.bfloat16)
    c[0, 0, 0] = float("nan")
    ok, info = testing.pass_rule(c, o)
    assert not ok and not info["nonfinite_match"]
