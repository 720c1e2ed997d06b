"""GPU tests of the CUDA kernel against the oracle (and SGLang's Triton kernel when importable)."""

from __future__ import annotations

import mla_tree_verify
import pytest
import torch
from mla_tree_verify import oracle, testing

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the kernel runs only there)"),
]

HAVE_TRITON = torch.cuda.is_available() and testing.sglang_triton_available()


#: the ``nonfinite_flag`` of the latest :func:`_run` (0 or 1)
NONFINITE = [0]


def _run(case, num_splits=None, lse=True, **kw):
    total, H = case.q.shape[0], case.q.shape[1]
    out = testing.poison_(torch.empty(total, H, 512, dtype=torch.bfloat16, device="cuda"))
    lse_t = testing.poison_(torch.empty(total, H, dtype=torch.float32, device="cuda")) if lse else None
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    nonfinite = torch.zeros(1, dtype=torch.int32, device="cuda")
    mla_tree_verify.tree_verify(
        *case.args(),
        out=out,
        lse=lse_t,
        error_flag=flag,
        max_q_len=case.max_q_len,
        num_splits=num_splits,
        nonfinite_flag=nonfinite,
        **kw,
    )
    torch.cuda.synchronize()
    NONFINITE[0] = int(nonfinite.item())
    return out, lse_t, int(flag.item())


def _oracle(case):
    return oracle.attention(*case.args(), dtype=torch.float64, return_lse=True)


def _assert_matches_oracle(case, splits=(None, 1, 5)):
    # at each split setting: no error bit, every output element written and finite, the project's pass rule
    # against the fp64 oracle (and SGLang's Triton kernel when importable), the LSE finite where the oracle's is
    # and within 1e-3 of it
    ref, ref_lse = _oracle(case)
    tri = None
    if HAVE_TRITON:
        tri = testing.run_sglang_triton(case, testing.poison_(torch.empty_like(case.q[..., :512])))
        torch.cuda.synchronize()
    for n in splits:
        out, lse, flag = _run(case, num_splits=n)
        assert flag == 0 and NONFINITE[0] == 0, (case.desc, n, flag, NONFINITE[0])
        assert torch.isfinite(out).all(), (case.desc, n, "unwritten/non-finite output")
        ok, info = testing.pass_rule(out, ref, tri)
        assert ok, (case.desc, n, info)
        fin = torch.isfinite(ref_lse)
        assert torch.equal(fin, torch.isfinite(lse)), (case.desc, n)
        assert (lse[fin].double() - ref_lse[fin]).abs().max().item() < 1e-3, (case.desc, n)


SPECS = testing.random_case_specs(2026, 28)


@pytest.mark.parametrize("spec", SPECS, ids=[f"case{i}" for i in range(len(SPECS))])
def test_random_cases_vs_oracle(spec):
    _assert_matches_oracle(testing.make_case(**spec, device="cuda"))


@pytest.mark.parametrize("splits", [37, 128, mla_tree_verify.MAX_SPLITS])
@pytest.mark.parametrize("T,H", [(4, 8), (20, 16), (40, 16), (72, 16)],
                         ids=["rows32", "rows320", "rows640", "rows1152"])
def test_combine_every_slice_count_and_split_count(T, H, splits):
    # the combine's column slices depend on the row count (32 -> 8 slices, 320 -> 4, 640 -> 2, 1152 -> 1);
    # L + T just under 256 * 32 rows makes every split of a 37-, 128- or 256-split call hold KV rows
    case = testing.make_case([8190 - T], [T], H, seed=T * 7 + splits, device="cuda")
    ref, ref_lse = _oracle(case)
    out, lse, flag = _run(case, num_splits=splits)
    assert flag == 0
    ok, info = testing.pass_rule(out, ref, None)
    assert ok, (T, H, splits, info)
    assert (lse.double() - ref_lse).abs().max().item() < 1e-3
    one, _, _ = _run(case, num_splits=1)
    assert (out.float() - one.float()).abs().max().item() <= 2 * testing.ulp_bf16(one.float().abs().max().item())


@pytest.mark.parametrize(
    "prefix_lens,tree_sizes,heads,kind,std",
    [
        ([3000], [4], 8, "random", 1.0),  # 32 rows: both row tiles of the small-call schedule live
        ([1500, 0, 1], [2, 1, 2], 8, "chain", 8.0),  # at most 16 rows per request: the second row tile empty
        ([777, 64], [3, 5], 4, "star", 1.0),  # 20 rows: the second row tile partly live
        ([257, 31], [1, 1], 1, "random", 5.0),  # one row per request
    ],
    ids=["rows32", "rows16-peaky", "rows20", "rows1"],
)
def test_small_call_schedule_vs_oracle(prefix_lens, tree_sizes, heads, kind, std):
    # calls of at most 32 rows per request (max_q_len * heads <= 32) run the K-quarter schedule (G = 4): every
    # warp's S partial spans both row tiles, and each block of S is finished from four warps' partials
    case = testing.make_case(prefix_lens, tree_sizes, heads, seed=sum(prefix_lens), device="cuda", tree_kind=kind,
                             logit_std=std)
    assert case.max_q_len * heads <= 32
    _assert_matches_oracle(case)


@pytest.mark.parametrize("splits", [1, 3])
def test_small_call_schedule_nonfinite_leaf_stays_in_its_rows(splits):
    # a NaN in a leaf draft's K (seen only by that draft) reaches exactly the oracle's non-finite rows in the
    # K-quarter schedule too (its blocks of S are summed from several warps' partials)
    case = testing.make_case([150, 40], [4, 3], 8, seed=21, device="cuda", tree_kind="chain")
    case.k_draft[3] = float("nan")  # the chain's last node of request 0: a leaf
    ref, _ = _oracle(case)
    out, _, _ = _run(case, num_splits=splits)
    nf_ref = ~torch.isfinite(ref)
    assert nf_ref.any() and (~nf_ref).any() and NONFINITE[0] == 1
    assert torch.equal(nf_ref, ~torch.isfinite(out)), (nf_ref.sum().item(), (~torch.isfinite(out)).sum().item())
    assert (out.double()[~nf_ref] - ref[~nf_ref]).abs().max().item() < 0.05


def test_index_dtypes_and_uint8_mask():
    case = testing.make_case([300, 0, 77], [9, 5, 12], 8, seed=4, device="cuda", mask_dtype=torch.uint8)
    case.qo_indptr = case.qo_indptr.long()
    case.kv_indptr = case.kv_indptr.long()
    case.kv_indices = case.kv_indices.int()
    case.mask_indptr = case.mask_indptr.int()
    ref, _ = _oracle(case)
    out, _, flag = _run(case)
    ok, info = testing.pass_rule(out, ref)
    assert ok and flag == 0, info


@pytest.mark.parametrize("heads", [8, 2], ids=["rows64", "rows16"])
@pytest.mark.parametrize("vscale", ["huge", "tiny", "spread"])
def test_split_partials_keep_range_and_precision(vscale, heads):
    # A split call's O partials go through the workspace and the combine: V values far outside fp16's range (1e30,
    # 1e-30) come back as the oracle's, and in a row whose columns span 2^12 in magnitude every column keeps its own
    # precision: the split result is within 4 bf16 ulps, per column, of the unsplit one.  (fp16 partials scaled
    # per row by a power of two passed this and were dropped as slower: bench/results/verify-2026-12-01.md.)
    case = testing.make_case([6000], [8], heads, seed=5, device="cuda")
    if vscale == "spread":
        col = (2.0 ** torch.linspace(0.0, -12.0, 512, device="cuda")).to(torch.bfloat16)
    else:
        col = torch.full((512,), 1e30 if vscale == "huge" else 1e-30, device="cuda").to(torch.bfloat16)
    case.kv_buffer[..., :512] *= col
    case.k_draft[..., :512] *= col
    ref, _ = _oracle(case)
    out, _, flag = _run(case, num_splits=16)
    assert flag == 0 and NONFINITE[0] == 0 and torch.isfinite(out).all()
    ok, info = testing.pass_rule(out, ref, None)
    assert ok, (vscale, info)
    one, _, _ = _run(case, num_splits=1)
    colmax = one.float().abs().amax(dim=(0, 1))
    tol = torch.tensor([4 * testing.ulp_bf16(v) for v in colmax.tolist()], device="cuda")
    err = (out.float() - one.float()).abs().amax(dim=(0, 1))
    assert (err <= tol).all(), (vscale, (err / tol).max().item())


def test_long_prefix_200k():
    case = testing.make_case([200_000], [16], 8, seed=5, device="cuda", logit_std=5.0)
    ref = oracle.attention(*case.args(), dtype=torch.float32, chunk=32768)
    out, _, flag = _run(case)
    ok, info = testing.pass_rule(out, ref)
    assert ok and flag == 0, info


def _nan_case(where: str):
    case = testing.make_case([200, 37], [16, 9], 8, seed=12, device="cuda", tree_kind="random")
    par = case.trees[0]
    children = {p for p in par if p >= 0}
    if where == "prefix":
        case.kv_buffer[int(case.kv_indices[5])] = float("nan")
    elif where == "ancestor":
        node = next(i for i in range(1, 16) if i in children)  # an inner node: ancestor of others
        case.k_draft[node] = float("nan")
    elif where == "leaf":
        node = next(i for i in range(1, 16) if i not in children)
        case.k_draft[node] = float("nan")
    elif where == "leaf_inf":
        node = next(i for i in range(1, 16) if i not in children)
        case.k_draft[node, 0, 3] = float("-inf")
    return case


@pytest.mark.parametrize("where", ["prefix", "ancestor", "leaf", "leaf_inf"])
@pytest.mark.parametrize("splits", [1, 3])
def test_nonfinite_exactly_where_oracle(where, splits):
    case = _nan_case(where)
    ref, _ = _oracle(case)
    out, _, _ = _run(case, num_splits=splits)
    nf_ref = ~torch.isfinite(ref)
    nf_out = ~torch.isfinite(out)
    assert nf_ref.any() and NONFINITE[0] == 1, "nonfinite_flag raised by a NaN / Inf output"
    assert torch.equal(nf_ref, nf_out), (where, nf_ref.sum().item(), nf_out.sum().item())
    if where != "prefix":
        assert (~nf_ref).any()  # the leak would make everything non-finite
    fin = ~nf_ref
    assert (out.double()[fin] - ref[fin]).abs().max().item() < 0.05


def test_error_flag_on_out_of_range_slot():
    case = testing.make_case([64], [4], 2, seed=13, device="cuda")
    case.kv_indices[3] = case.kv_buffer.shape[0] + 1000
    out, _, flag = _run(case)
    assert flag & 1
    assert torch.isfinite(out).all()


def test_all_zero_indptr_is_no_work_and_no_error():
    # what the hook's candidate gate hands the kernel on replays that do not use it: every request empty,
    # nothing written, no error bit (all-zero index pointers are consistent)
    import dataclasses

    case = testing.make_case([300, 0, 17], [5, 3, 9], 4, seed=21, device="cuda")
    empty = dataclasses.replace(case, qo_indptr=torch.zeros_like(case.qo_indptr),
                                kv_indptr=torch.zeros_like(case.kv_indptr))
    out, lse, flag = _run(empty)
    assert flag == 0 and NONFINITE[0] == 0, "the poison left in place is no output of the kernel's"
    assert torch.isnan(out).all() and torch.isnan(lse).all()  # still the poison: nothing written


@pytest.mark.parametrize(
    "tree,heads,seed",
    [
        (40, 8, 14),  # 64 declared rows (the 2-warps-per-row-tile schedule), 320 real ones
        (12, 4, 15),  # 32 declared rows (the small-call schedule, two row tiles per CTA), 48 real ones
    ],
)
def test_error_flag_when_a_request_has_more_rows_than_max_q_len(tree, heads, seed):
    # a request with more draft tokens than max_q_len declares is flagged (bit 2), not silently half computed
    case = testing.make_case([10], [tree], heads, seed=seed, device="cuda")
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    mla_tree_verify.tree_verify(*case.args(), error_flag=flag, max_q_len=8)
    torch.cuda.synchronize()
    assert int(flag.item()) & 2


def test_cuda_graph_replay_matches_eager():
    H, T, B = 8, 12, 3
    cap_slots = 6000
    base = testing.make_case([900, 0, 1500], [T] * B, H, seed=20, device="cuda", extra_slots=cap_slots)
    total = B * T
    # static buffers sized from maxima
    q = base.q.clone()
    kd = base.k_draft.clone()
    kv = torch.zeros(20000, 1, 576, dtype=torch.bfloat16, device="cuda")
    kv[: base.kv_buffer.shape[0]] = base.kv_buffer
    qo = base.qo_indptr.clone()
    kvp = base.kv_indptr.clone()
    kvi = torch.zeros(cap_slots, dtype=torch.int64, device="cuda")
    kvi[: base.kv_indices.numel()] = base.kv_indices
    mask_cap = B * T * (cap_slots + T)
    mask = torch.zeros(mask_cap, dtype=torch.uint8, device="cuda")
    mask[: base.custom_mask.numel()] = base.custom_mask.to(torch.uint8)
    mip = base.mask_indptr.clone()
    out = torch.empty(total, H, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(total, H, dtype=torch.float32, device="cuda")
    splits = 6
    ws = torch.empty(mla_tree_verify.workspace_size(B, total, H, splits), dtype=torch.uint8, device="cuda")
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")

    def call():
        mla_tree_verify.tree_verify(
            q,
            kd,
            kv,
            qo,
            kvp,
            kvi,
            mask,
            mip,
            base.sm_scale,
            out=out,
            lse=lse,
            workspace=ws,
            error_flag=flag,
            max_q_len=T,
            num_splits=splits,
        )

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call()  # warm-up (builds/loads the library, sets the smem attribute)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        call()
    for step, lens in enumerate([[1200, 3, 0], [0, 0, 2500], [4000, 1, 17]]):
        new = testing.make_case(lens, [T] * B, H, seed=100 + step, device="cuda", extra_slots=cap_slots)
        q.copy_(new.q)
        kd.copy_(new.k_draft)
        kv[: new.kv_buffer.shape[0]].copy_(new.kv_buffer)
        qo.copy_(new.qo_indptr)
        kvp.copy_(new.kv_indptr)
        kvi[: new.kv_indices.numel()] = new.kv_indices
        mask[: new.custom_mask.numel()] = new.custom_mask.to(torch.uint8)
        mip.copy_(new.mask_indptr)
        testing.poison_(out)
        g.replay()
        torch.cuda.synchronize()
        replayed = out.clone()
        eager = testing.poison_(torch.empty_like(out))
        mla_tree_verify.tree_verify(*new.args(), out=eager, max_q_len=T, num_splits=splits)
        torch.cuda.synchronize()
        assert torch.equal(replayed, eager), step
        ref = oracle.attention(*new.args(), dtype=torch.float64)
        ok, info = testing.pass_rule(replayed, ref)
        assert ok, info
    assert int(flag.item()) == 0


def test_sanitizer_case2_poisoned():
    """The causal / splits=3 launch that printed non-finite output under compute-sanitizer initcheck only
    (see bench/results/verify-2026-11-29.md); here with NaN-poisoned outputs against the oracle."""
    case = testing.make_case([300], [17], 8, seed=2, device="cuda", use_mask=False)
    ref, _ref_lse = _oracle(case)
    out, lse, flag = _run(case, num_splits=3)
    assert flag == 0 and torch.isfinite(out).all() and torch.isfinite(lse).all()
    ok, info = testing.pass_rule(out, ref)
    assert ok, info
