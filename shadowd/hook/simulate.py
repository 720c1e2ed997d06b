"""A simulated MLA tree-verify workload for the demo and the tests (CPU, torch only).

The attention is the absorbed MLA tree verify of ../shared/CONTEXT.md §1: per request b, q rows
[T_b, H, 576] attend to the prefix latent rows ``kv_buffer[kv_indices[kv_indptr[b]:kv_indptr[b+1]]]``
and to the request's own draft rows ``k_draft`` (visible along the tree's ancestor mask); V is the
first 512 columns of the same rows; output [ΣT, H, 512] bf16. Arguments are SGLang's
target-verify metadata in the order of ``mla_tree_verify``:
``(q, k_draft, kv_buffer, qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr, sm_scale)``.

Two different correct implementations, so their diffs are real rounding differences:

* :func:`baseline_attention` — gathered, one fp32 softmax over all visible columns, fp32 P·V,
  bf16 output (what SGLang's Triton path computes);
* :func:`candidate_attention` — ``mla_tree_verify.reference`` (blockwise online softmax with bf16
  probabilities) when the kernel package is importable, else a split-KV variant here (two halves,
  bf16 probabilities, log-sum-exp merge);
* :func:`oracle_attention` — fp32 output of an fp64 computation (``mla_tree_verify.oracle`` when
  importable), chunked over query rows.

:func:`make_case` builds random inputs; :func:`faulty` wraps a candidate with a planted fault, and
:data:`FAULT_REFS` names each fault's importable full-size form (``nan_candidate`` …), which the demo's repro
bundles carry so that ``shadowd replay`` reruns them.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["CRASH_TREE", "DRIFT_GAIN", "D_QK", "D_V", "FAULTS", "FAULT_REFS", "SM_SCALE", "baseline_attention",
           "bias_candidate", "candidate_attention", "crash_candidate", "drift_candidate", "faulty", "make_case",
           "nan_candidate", "oracle_attention"]

D_QK, D_V = 576, 512
SM_SCALE = 192 ** -0.5
FAULTS = ("none", "nan", "bias", "drift", "crash")


def _visible(custom_mask: torch.Tensor | None, mask_indptr: torch.Tensor | None, b: int, L: int, T: int
             ) -> torch.Tensor:
    """[T, L+T] bool: prefix all visible, drafts by the tree mask (causal when the mask is None)."""
    vis = torch.ones(T, L + T, dtype=torch.bool)
    if custom_mask is None or mask_indptr is None:
        vis[:, L:] = torch.ones(T, T, dtype=torch.bool).tril()
    else:
        s = int(mask_indptr[b])
        vis[:, L:] = custom_mask[s:s + T * (L + T)].reshape(T, L + T)[:, L:].to(torch.bool)
    return vis


def _attend(q: torch.Tensor, k_draft: torch.Tensor, kv_buffer: torch.Tensor, qo_indptr: torch.Tensor,
            kv_indptr: torch.Tensor, kv_indices: torch.Tensor, custom_mask: torch.Tensor | None,
            mask_indptr: torch.Tensor | None, sm_scale: float, dtype: torch.dtype, splits: int,
            p_dtype: torch.dtype | None, out_dtype: torch.dtype) -> torch.Tensor:
    total, H = q.shape[0], q.shape[1]
    kv = kv_buffer.reshape(kv_buffer.shape[0], D_QK)
    kd = k_draft.reshape(k_draft.shape[0], D_QK)
    out = torch.zeros(total, H, D_V, dtype=out_dtype)
    qo = qo_indptr.tolist()
    kvp = kv_indptr.tolist()
    for b in range(len(qo) - 1):
        q0, q1 = qo[b], qo[b + 1]
        T = q1 - q0
        if T <= 0:
            continue
        L = kvp[b + 1] - kvp[b]
        keys = torch.cat([kv[kv_indices[kvp[b]:kvp[b + 1]].long()], kd[q0:q1]]).to(dtype)  # [L+T, 576]
        vis = _visible(custom_mask, mask_indptr, b, L, T)  # [T, L+T]
        qb = q[q0:q1].to(dtype)  # [T, H, 576]
        s = torch.einsum("thd,nd->thn", qb, keys) * sm_scale
        s = s.masked_fill(~vis[:, None, :], -math.inf)
        bounds = [round(i * (L + T) / splits) for i in range(splits + 1)]
        acc = torch.zeros(T, H, D_V, dtype=dtype)
        m_all = s.amax(-1, keepdim=True)
        denom = torch.zeros(T, H, 1, dtype=dtype)
        for j0, j1 in itertools.pairwise(bounds):
            if j1 <= j0:
                continue
            sj = s[..., j0:j1]
            m = sj.amax(-1, keepdim=True)
            m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
            p = torch.exp(sj - m_safe)
            w = torch.exp(torch.where(torch.isfinite(m), m - m_all, torch.full_like(m, -math.inf)))
            denom += p.sum(-1, keepdim=True) * w
            if p_dtype is not None:
                p = p.to(p_dtype).to(dtype)
            acc += torch.einsum("thn,nd->thd", p, keys[j0:j1, :D_V]) * w
        out[q0:q1] = (acc / denom).to(out_dtype)
    return out


def baseline_attention(q: torch.Tensor, k_draft: torch.Tensor, kv_buffer: torch.Tensor, qo_indptr: torch.Tensor,
                       kv_indptr: torch.Tensor, kv_indices: torch.Tensor, custom_mask: torch.Tensor | None,
                       mask_indptr: torch.Tensor | None, sm_scale: float) -> torch.Tensor:
    """Gathered fp32 softmax and P·V, bf16 output (the Triton-like baseline)."""
    return _attend(q, k_draft, kv_buffer, qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr, sm_scale,
                   torch.float32, 1, None, torch.bfloat16)


def candidate_attention(q: torch.Tensor, k_draft: torch.Tensor, kv_buffer: torch.Tensor, qo_indptr: torch.Tensor,
                        kv_indptr: torch.Tensor, kv_indices: torch.Tensor, custom_mask: torch.Tensor | None,
                        mask_indptr: torch.Tensor | None, sm_scale: float) -> torch.Tensor:
    """A second correct implementation: the kernel package's blockwise reference, else split-KV here."""
    try:
        from mla_tree_verify import reference
    except ImportError:
        return _attend(q, k_draft, kv_buffer, qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr,
                       sm_scale, torch.float32, 2, torch.bfloat16, torch.bfloat16)
    out: torch.Tensor = reference.attention(q, k_draft, kv_buffer, qo_indptr, kv_indptr, kv_indices, custom_mask,
                                            mask_indptr, sm_scale, block=256)
    return out


def oracle_attention(q: torch.Tensor, k_draft: torch.Tensor, kv_buffer: torch.Tensor, qo_indptr: torch.Tensor,
                     kv_indptr: torch.Tensor, kv_indices: torch.Tensor, custom_mask: torch.Tensor | None,
                     mask_indptr: torch.Tensor | None, sm_scale: float) -> torch.Tensor:
    """fp32 output of an fp64 computation (``mla_tree_verify.oracle``, chunked, when importable)."""
    try:
        from mla_tree_verify import oracle
    except ImportError:
        return _attend(q, k_draft, kv_buffer, qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr,
                       sm_scale, torch.float64, 1, None, torch.float32)
    out: torch.Tensor = oracle.attention(q, k_draft, kv_buffer, qo_indptr, kv_indptr, kv_indices, custom_mask,
                                         mask_indptr, sm_scale, dtype=torch.float32)
    return out


def make_case(prefix_lens: list[int], tree_sizes: list[int], heads: int, seed: int = 0
              ) -> tuple[Any, ...]:
    """Random verify inputs (scattered prefix slots, random trees) as the argument tuple."""
    g = torch.Generator().manual_seed(seed)
    B = len(prefix_lens)
    num_slots = sum(prefix_lens) + 1 + 16
    perm = torch.randperm(num_slots - 1, generator=g)[: sum(prefix_lens)] + 1  # slot 0 is the padding dummy
    kv_indptr = torch.tensor([0, *torch.tensor(prefix_lens).cumsum(0).tolist()], dtype=torch.int32)
    qo_indptr = torch.tensor([0, *torch.tensor(tree_sizes).cumsum(0).tolist()], dtype=torch.int32)
    masks, mask_indptr = [], [0]
    for L, T in zip(prefix_lens, tree_sizes, strict=True):
        parent = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, T)]
        anc = torch.zeros(T, T, dtype=torch.bool)
        for i in range(T):
            j = i
            while j >= 0:
                anc[i, j] = True
                j = parent[j]
        m = torch.ones(T, L + T, dtype=torch.bool)
        m[:, L:] = anc
        masks.append(m.reshape(-1))
        mask_indptr.append(mask_indptr[-1] + T * (L + T))
    total = sum(tree_sizes)
    q_std = 1.0 / (SM_SCALE * math.sqrt(D_QK))
    q = (torch.randn(total, heads, D_QK, generator=g) * q_std).to(torch.bfloat16)
    k_draft = torch.randn(total, 1, D_QK, generator=g).to(torch.bfloat16)
    kv = torch.randn(num_slots, 1, D_QK, generator=g).to(torch.bfloat16)
    assert len(tree_sizes) == B
    return (q, k_draft, kv, qo_indptr, kv_indptr, perm.to(torch.int32), torch.cat(masks),
            torch.tensor(mask_indptr, dtype=torch.int32), SM_SCALE)


#: the full-size form of each planted fault, importable as ``module:function``: what a repro bundle of the demo
#: names as its candidate, so that ``shadowd replay`` reruns the faulty candidate (``none``: the correct one)
FAULT_REFS = {"none": f"{__name__}:candidate_attention", "nan": f"{__name__}:nan_candidate",
              "bias": f"{__name__}:bias_candidate", "drift": f"{__name__}:drift_candidate",
              "crash": f"{__name__}:crash_candidate"}
#: the drift fault's rounding-difference amplification at full size (it grows to this over ``duration_s``)
DRIFT_GAIN = 31.0
#: the crash fault raises on trees larger than this
CRASH_TREE = 16


def _crash_check(args: tuple[Any, ...]) -> None:
    if int((args[3][1:] - args[3][:-1]).max()) > CRASH_TREE:
        raise RuntimeError("tree_verify: unsupported tree size (planted fault)")


def _plant_nan(out: torch.Tensor) -> torch.Tensor:
    out = out.clone()
    out[-1, 0, :4] = float("nan")
    return out


def _plant_bias(out: torch.Tensor) -> torch.Tensor:
    return (out.float() + 2.0**-4 * out.float().abs().amax()).to(out.dtype)


def _plant_drift(out: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any], gain: float) -> torch.Tensor:
    base = baseline_attention(*args, **kwargs).float()
    return (base + (out.float() - base) * gain).to(out.dtype)


def nan_candidate(*args: Any, **kwargs: Any) -> torch.Tensor:
    """:func:`candidate_attention` with NaN in four elements of its last row (the ``nan`` fault's faulty calls)."""
    return _plant_nan(candidate_attention(*args, **kwargs))


def bias_candidate(*args: Any, **kwargs: Any) -> torch.Tensor:
    """:func:`candidate_attention` shifted by 2^-4 of its largest |output| (the ``bias`` fault)."""
    return _plant_bias(candidate_attention(*args, **kwargs))


def drift_candidate(*args: Any, **kwargs: Any) -> torch.Tensor:
    """:func:`candidate_attention`'s rounding difference from the baseline amplified :data:`DRIFT_GAIN` times (the
    ``drift`` fault at full size)."""
    return _plant_drift(candidate_attention(*args, **kwargs), args, kwargs, DRIFT_GAIN)


def crash_candidate(*args: Any, **kwargs: Any) -> torch.Tensor:
    """:func:`candidate_attention`, raising on trees larger than :data:`CRASH_TREE` tokens (the ``crash`` fault)."""
    _crash_check(args)
    return candidate_attention(*args, **kwargs)


def faulty(candidate: Callable[..., torch.Tensor], fault: str, *, duration_s: float = 60.0
           ) -> Callable[..., torch.Tensor]:
    """``candidate`` with a planted fault: ``nan`` (NaN in 1 of 7 calls), ``bias`` (+2^-4 of the
    output scale), ``drift`` (its rounding difference amplified, growing with time over ``duration_s`` to
    :data:`DRIFT_GAIN` times), ``crash`` (raises on trees larger than :data:`CRASH_TREE` tokens), ``none``
    (unchanged). :data:`FAULT_REFS` names each fault's full-size form (every call faulty, the drift grown)."""
    if fault not in FAULTS:
        raise ValueError(f"fault must be one of {FAULTS}, got {fault!r}")
    if fault == "none":
        return candidate
    t0 = time.monotonic()
    calls = [0]

    def wrapped(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls[0] += 1
        if fault == "crash":
            _crash_check(args)
        out = candidate(*args, **kwargs)
        if fault == "nan" and calls[0] % 7 == 0:
            out = _plant_nan(out)
        elif fault == "bias":
            out = _plant_bias(out)
        elif fault == "drift":
            frac = min(1.0, (time.monotonic() - t0) / max(duration_s, 1e-3))
            out = _plant_drift(out, args, kwargs, 1.0 + (DRIFT_GAIN - 1.0) * frac**2)
        return out

    return wrapped
