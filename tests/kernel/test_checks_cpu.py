"""Host-side argument checks: each bad argument raises ArgumentError naming it (no CUDA needed)."""

from __future__ import annotations

import re
from pathlib import Path

import mla_tree_verify
import numpy as np
import pytest
import torch
from mla_tree_verify import ArgumentError, testing, validate_args


def _args():
    c = testing.make_case([4, 2], [3, 2], 2, seed=1)
    return dict(
        q=c.q,
        k_draft=c.k_draft,
        kv_buffer=c.kv_buffer,
        qo_indptr=c.qo_indptr,
        kv_indptr=c.kv_indptr,
        kv_indices=c.kv_indices,
        custom_mask=c.custom_mask,
        mask_indptr=c.mask_indptr,
        sm_scale=c.sm_scale,
    )


def _check(**over):
    a = _args()
    a.update(over)
    validate_args(**a, require_cuda=False)


def test_valid_args_pass():
    _check()
    _check(custom_mask=None, mask_indptr=None)
    a = _args()
    _check(
        custom_mask=a["custom_mask"].to(torch.uint8),
        qo_indptr=a["qo_indptr"].long(),
        kv_indices=a["kv_indices"].int(),
        out=torch.empty(5, 2, 512, dtype=torch.bfloat16),
        lse=torch.empty(5, 2),
        error_flag=torch.zeros(1, dtype=torch.int32),
    )


@pytest.mark.parametrize(
    "name,bad",
    [
        ("q", lambda a: a["q"].float()),
        ("q", lambda a: a["q"][:, :, :512]),
        ("q", lambda a: torch.zeros(5, 2, 1152, dtype=torch.bfloat16)[:, :, ::2]),
        ("k_draft", lambda a: a["k_draft"][:4]),
        ("k_draft", lambda a: a["k_draft"].half()),
        ("kv_buffer", lambda a: a["kv_buffer"].reshape(-1, 2, 288)),
        ("qo_indptr", lambda a: a["qo_indptr"].float()),
        ("kv_indptr", lambda a: a["kv_indptr"][:2]),
        ("kv_indices", lambda a: a["kv_indices"].reshape(2, -1)),
        ("custom_mask", lambda a: a["custom_mask"].float()),
        ("mask_indptr", lambda a: a["mask_indptr"].to(torch.int16)),
        ("sm_scale", lambda a: float("nan")),
        ("sm_scale", lambda a: -1.0),
        # finite in float64, not in the kernel's float32 (inf there, or 0), or beyond float64 altogether
        ("sm_scale", lambda a: 1e300),
        ("sm_scale", lambda a: 1e-60),
        ("sm_scale", lambda a: 10**400),
    ],
)
def test_bad_argument_is_named(name, bad):
    a = _args()
    with pytest.raises(ArgumentError) as ei:
        _check(**{name: bad(a)})
    assert ei.value.argument == name
    assert f"'{name}'" in str(ei.value)


@pytest.mark.parametrize(
    "name,val",
    [
        ("out", torch.empty(5, 2, 511, dtype=torch.bfloat16)),
        ("out", torch.empty(5, 2, 512, dtype=torch.float32)),
        ("lse", torch.empty(5, 3)),
        ("error_flag", torch.zeros(1, dtype=torch.int64)),
        ("nonfinite_flag", torch.zeros(1, dtype=torch.float32)),
        ("nonfinite_flag", torch.zeros(0, dtype=torch.int32)),
    ],
)
def test_bad_output_is_named(name, val):
    with pytest.raises(ArgumentError) as ei:
        _check(**{name: val})
    assert ei.value.argument == name


def test_messages_show_the_bad_values():
    # the messages are formatted only when a check fails: they still carry the values that failed
    a = _args()
    with pytest.raises(ArgumentError, match=r"expected shape \[tokens, heads, 576\], got \(5, 2, 512\)"):
        _check(q=a["q"][:, :, :512])
    with pytest.raises(ArgumentError, match=r"kv_indptr.*expected length 3, got 2"):
        _check(kv_indptr=a["kv_indptr"][:2])
    with pytest.raises(ArgumentError, match=r"'sm_scale'.*got -1\.0"):
        _check(sm_scale=-1.0)
    with pytest.raises(ArgumentError, match=r"'out'.*expected shape \(5, 2, 512\), got \(5, 2, 511\)"):
        _check(out=torch.empty(5, 2, 511, dtype=torch.bfloat16))


def test_missing_mask_indptr_named():
    with pytest.raises(ArgumentError) as ei:
        _check(mask_indptr=None)
    assert ei.value.argument == "mask_indptr"


def test_cpu_tensors_rejected_naming_q():
    a = _args()
    with pytest.raises(ArgumentError) as ei:
        mla_tree_verify.tree_verify(**a)
    assert ei.value.argument == "q" and "CUDA" in str(ei.value)


def test_python_split_limit_is_the_librarys():
    # the launcher refuses num_splits above the C++ constant; the Python side clamps to its own copy
    src = (Path(mla_tree_verify.__file__).parent / "csrc" / "common" / "tree_verify_kernel.cuh").read_text()
    assert re.search(r"constexpr int MAX_SPLITS = (\d+);", src).group(1) == str(mla_tree_verify.MAX_SPLITS)


def test_workspace_and_splits_helpers():
    assert mla_tree_verify.workspace_size(4, 100, 8, 1) == 0
    assert mla_tree_verify.workspace_size(4, 100, 8, 4) == 4 * 100 * 8 * 513 * 4
    assert mla_tree_verify.workspace_size(4, 100, 8) == mla_tree_verify.MAX_SPLITS * 100 * 8 * 513 * 4
    s = mla_tree_verify.choose_num_splits(1, 16, 8, 32768, 132)
    assert 1 <= s <= 128
    assert mla_tree_verify.choose_num_splits(4, 64, 64, 32768, 132) == 1
    # one wave of CTAs for the library's rows per CTA: 16 drafts x 8 heads = 2 row tiles of 64, 4 of 32
    assert mla_tree_verify.choose_num_splits(1, 16, 8, 32768, 132) == 66
    assert mla_tree_verify.choose_num_splits(1, 16, 8, 32768, 132, block_m=32) == 33
    # one request of one row tile: a split per SM, on the H200 (132) and the RTX PRO 6000 (188)
    assert mla_tree_verify.choose_num_splits(1, 4, 8, 200_000, 132) == 132
    assert mla_tree_verify.choose_num_splits(1, 4, 8, 200_000, 188) == 188
    assert mla_tree_verify.decode_error_flag(5) == [
        mla_tree_verify.ERROR_BITS[1],
        mla_tree_verify.ERROR_BITS[4],
    ]


def _variants():
    """Argument sets, valid and not, over every condition the checks hold (name, overrides)."""
    a = _args()
    big = torch.zeros(5, 4, 576, dtype=torch.bfloat16)
    yield "valid", {}
    yield "causal", dict(custom_mask=None, mask_indptr=None)
    yield "causal, stray mask_indptr", dict(custom_mask=None)
    yield "uint8 mask, int64 indptr", dict(custom_mask=a["custom_mask"].to(torch.uint8),
                                           qo_indptr=a["qo_indptr"].long())
    yield "outputs given", dict(out=torch.empty(5, 2, 512, dtype=torch.bfloat16), lse=torch.empty(5, 2),
                                error_flag=torch.zeros(1, dtype=torch.int32),
                                nonfinite_flag=torch.zeros(1, dtype=torch.int32),
                                workspace=torch.empty(64, dtype=torch.uint8))
    yield "2-D k and kv", dict(k_draft=a["k_draft"].reshape(5, 576), kv_buffer=a["kv_buffer"].reshape(-1, 576))
    yield "q a strided view", dict(q=big[:, ::2])
    yield "int sm_scale", dict(sm_scale=1)
    yield "bool sm_scale", dict(sm_scale=True)
    yield "q fp32", dict(q=a["q"].float())
    yield "q 512 wide", dict(q=a["q"][:, :, :512])
    yield "q odd head stride", dict(q=torch.zeros(5, 2, 1152, dtype=torch.bfloat16)[:, :, ::2])
    yield "q no heads", dict(q=a["q"][:, :0])
    yield "q token stride", dict(q=torch.zeros(5 * 2 * 576 + 4, dtype=torch.bfloat16)[4:].reshape(5, 2, 576))
    yield "k rows", dict(k_draft=a["k_draft"][:4])
    yield "k fp16", dict(k_draft=a["k_draft"].half())
    yield "kv layout", dict(kv_buffer=a["kv_buffer"].reshape(-1, 2, 288))
    yield "kv empty", dict(kv_buffer=a["kv_buffer"][:0])
    yield "qo fp32", dict(qo_indptr=a["qo_indptr"].float())
    yield "qo empty", dict(qo_indptr=a["qo_indptr"][:0])
    yield "kv_indptr length", dict(kv_indptr=a["kv_indptr"][:2])
    yield "kv_indptr strided", dict(kv_indptr=torch.zeros(6, dtype=torch.int32)[::2])
    yield "kv_indices 2-D", dict(kv_indices=a["kv_indices"].reshape(2, -1))
    yield "mask fp32", dict(custom_mask=a["custom_mask"].float())
    yield "mask 2-D", dict(custom_mask=a["custom_mask"].reshape(1, -1))
    yield "mask_indptr int16", dict(mask_indptr=a["mask_indptr"].to(torch.int16))
    yield "mask_indptr missing", dict(mask_indptr=None)
    yield "sm_scale nan", dict(sm_scale=float("nan"))
    yield "sm_scale negative", dict(sm_scale=-1.0)
    yield "sm_scale str", dict(sm_scale="0.1")
    yield "sm_scale beyond float32", dict(sm_scale=1e39)
    yield "sm_scale below float32", dict(sm_scale=1e-46)
    yield "sm_scale tiny in float32", dict(sm_scale=1e-40)
    yield "out width", dict(out=torch.empty(5, 2, 511, dtype=torch.bfloat16))
    yield "out fp32", dict(out=torch.empty(5, 2, 512, dtype=torch.float32))
    yield "out odd stride", dict(out=torch.empty(5, 2, 513, dtype=torch.bfloat16)[:, :, :512])
    yield "lse shape", dict(lse=torch.empty(5, 3))
    yield "workspace strided", dict(workspace=torch.empty(64, dtype=torch.uint8)[::2])
    yield "error_flag int64", dict(error_flag=torch.zeros(1, dtype=torch.int64))
    yield "error_flag empty", dict(error_flag=torch.zeros(0, dtype=torch.int32))
    yield "nonfinite_flag float", dict(nonfinite_flag=torch.zeros(1))
    yield "nonfinite_flag empty", dict(nonfinite_flag=torch.zeros(0, dtype=torch.int32))
    yield "q not a tensor", dict(q=[1.0])
    yield "numpy sm_scale", dict(sm_scale=np.float32(0.1))
    yield "out expanded", dict(out=torch.empty(1, 2, 512, dtype=torch.bfloat16).expand(5, 2, 512))
    yield "lse expanded", dict(lse=torch.empty(1, 2).expand(5, 2))


@pytest.mark.parametrize("name,over", list(_variants()), ids=[n for n, _ in _variants()])
def test_fast_acceptance_agrees_with_the_labelled_checks(name, over):
    # validate_args first tests every condition inline (_accepts) and runs the labelled checks only
    # when it does not accept: it must never accept what they refuse, and it must accept the plain valid calls
    # (else every call would pay the slow path)
    from mla_tree_verify._checks import _accepts, _labelled

    a = _args()
    a.update(over)
    args = [a.get(k) for k in ("q", "k_draft", "kv_buffer", "qo_indptr", "kv_indptr", "kv_indices", "custom_mask",
                               "mask_indptr", "sm_scale", "out", "lse", "workspace", "error_flag",
                               "nonfinite_flag")]
    try:
        _labelled(*args, False)
        ok = True
    except ArgumentError:
        ok = False
    accepted = _accepts(*args, False)
    assert not accepted or ok, f"{name}: accepted what the labelled checks refuse"
    if name in ("valid", "causal", "causal, stray mask_indptr", "uint8 mask, int64 indptr", "outputs given",
                "2-D k and kv", "q a strided view", "int sm_scale", "numpy sm_scale", "sm_scale tiny in float32"):
        assert accepted and ok, name
    else:  # (a bool sm_scale, 0-stride outputs: refused by both, named by the labelled checks)
        assert not ok, f"{name}: expected the labelled checks to refuse it"


@pytest.mark.parametrize("kw,name", [(dict(max_q_len=0), "max_q_len"), (dict(max_q_len=2.5), "max_q_len"),
                                     (dict(max_q_len=True), "max_q_len"), (dict(num_splits=0), "num_splits"),
                                     (dict(num_splits=10**6), "num_splits"),
                                     # (a c_int32: 2^32 + 1 became 1, and the kernel dropped rows)
                                     (dict(max_q_len=2**31), "max_q_len"), (dict(max_q_len=2**32 + 1), "max_q_len")])
def test_launch_integers_are_checked_naming_them(kw, name):
    # max_q_len 0 launched nothing and returned an unwritten output; num_splits out of range was clamped silently.
    # (Checked before the tensors: these CPU tensors would be refused next, naming q.)
    import mla_tree_verify

    with pytest.raises(ArgumentError) as ei:
        mla_tree_verify.tree_verify(**{**_args(), **kw})
    assert ei.value.argument == name
    with pytest.raises(ArgumentError) as ei:
        mla_tree_verify.tree_verify(**_args(), max_q_len=np.int64(3), num_splits=np.int32(2))
    assert ei.value.argument == "q", "numpy integers are integers"


def _without_tensor_checks(monkeypatch):
    # the launch-shape checks that follow validate_args, reached on CPU: the tensor checks (which want CUDA) off,
    # no launch may happen, and the library's rows per CTA given (asking it would build the library with nvcc)
    import mla_tree_verify
    from mla_tree_verify import _lib

    def no_launch(*a, **k):
        raise AssertionError("launched")

    monkeypatch.setattr(mla_tree_verify, "validate_args", lambda *a, **k: None)
    monkeypatch.setattr(mla_tree_verify, "block_m", lambda: 64)
    monkeypatch.setattr(_lib, "launch", no_launch)
    return mla_tree_verify


def test_an_empty_batch_returns_its_empty_output_without_a_launch(monkeypatch):
    mtv = _without_tensor_checks(monkeypatch)
    a = _args()
    a.update(q=a["q"][:0], k_draft=a["k_draft"][:0], qo_indptr=torch.zeros(2, dtype=torch.int32))
    out = mtv.tree_verify(**a)
    assert out.shape == (0, 2, 512) and out.dtype == torch.bfloat16


def test_a_grid_beyond_cudas_limit_asks_for_max_q_len(monkeypatch):
    # ΣT 32768 at 128 heads with the default max_q_len (ΣT): 65536 row tiles of 64 (the library said only
    # "negative or zero size"); meta tensors: no memory
    mtv = _without_tensor_checks(monkeypatch)
    a = _args()
    a.update(q=torch.empty(32768, 128, 576, dtype=torch.bfloat16, device="meta"),
             k_draft=torch.empty(32768, 1, 576, dtype=torch.bfloat16, device="meta"), out=None)
    with pytest.raises(ArgumentError, match="pass max_q_len") as ei:
        mtv.tree_verify(**a)
    assert ei.value.argument == "max_q_len"
    a.update(qo_indptr=torch.zeros(65537, dtype=torch.int32, device="meta"))
    with pytest.raises(ArgumentError, match="at most 65535") as ei:
        mtv.tree_verify(**a, max_q_len=16)
    assert ei.value.argument == "qo_indptr"
