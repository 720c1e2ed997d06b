"""A second, differently structured correct CPU implementation: blockwise "flash" attention.

Where :mod:`mla_tree_verify.oracle` is float64 over gathered visible rows, this one mirrors what a
tensor-core kernel does: bf16 inputs, float32 accumulation, KV processed in blocks of ``block``
rows over the concatenated [prefix ; drafts] sequence with an online softmax in the log2 domain,
the probabilities rounded to bf16 before P.V, masking by *selection* (-inf), and non-finite V
values of draft rows zeroed in the block and re-injected as NaN only into the rows that may see
them.  Its differences from the oracle are real rounding differences (bf16 P, fp32 sums), which
makes it the second independent CPU implementation for demos of the comparison machinery.
"""

from __future__ import annotations

import math

import torch

from .oracle import D_QK, D_V, tree_visibility

LOG2E = 1.4426950408889634


def attention(
    q,
    k_draft,
    kv_buffer,
    qo_indptr,
    kv_indptr,
    kv_indices,
    custom_mask,
    mask_indptr,
    sm_scale,
    *,
    block: int = 64,
    return_lse: bool = False,
):
    """Return out [ΣT, H, 512] bf16 (and fp32 natural-log LSE [ΣT, H] when ``return_lse``)."""
    dev = q.device
    total, H = q.shape[0], q.shape[1]
    kv = kv_buffer.reshape(kv_buffer.shape[0], D_QK)
    kd = k_draft.reshape(k_draft.shape[0], D_QK)
    qo = [int(x) for x in qo_indptr.cpu()]
    kvp = [int(x) for x in kv_indptr.cpu()]
    out = torch.zeros(total, H, D_V, dtype=torch.bfloat16, device=dev)
    lse_out = torch.full((total, H), float("-inf"), dtype=torch.float32, device=dev)
    scale2 = float(sm_scale) * LOG2E
    for b in range(len(qo) - 1):
        q0, q1 = qo[b], qo[b + 1]
        T = q1 - q0
        if T <= 0:
            continue
        k0, k1 = kvp[b], kvp[b + 1]
        L = k1 - k0
        qb = q[q0:q1].to(torch.bfloat16).float().reshape(T * H, D_QK)  # rows r = t*H + h
        vis_d = tree_visibility(custom_mask, mask_indptr, b, L, T, dev)  # [T, T]
        row_t = torch.arange(T * H, device=dev) // H
        m = torch.full((T * H,), float("-inf"), device=dev)
        lsum = torch.zeros(T * H, device=dev)
        acc = torch.zeros(T * H, D_V, device=dev)
        for j0 in range(0, L + T, block):
            j1 = min(L + T, j0 + block)
            pre = slice(j0, min(j1, L))
            parts = []
            if pre.start < pre.stop:
                parts.append(kv[kv_indices[k0 + pre.start : k0 + pre.stop].to(dev).long()])
            if j1 > L:
                parts.append(kd[q0 + max(j0, L) - L : q0 + j1 - L])
            K = torch.cat(parts).to(torch.bfloat16).float()  # [n, 576]
            s = (qb @ K.T) * scale2  # fp32 accumulate of bf16 inputs
            cols = torch.arange(j0, j1, device=dev)
            vis = torch.ones(T * H, j1 - j0, dtype=torch.bool, device=dev)
            dcols = cols >= L
            if dcols.any():
                vis[:, dcols] = vis_d[row_t][:, (cols[dcols] - L)]
            s = torch.where(vis, s, torch.full_like(s, float("-inf")))
            m_new = torch.maximum(m, torch.nan_to_num(s, nan=float("-inf")).amax(-1))
            m_use = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
            alpha = torch.exp2(m - m_use)
            p = torch.exp2(s - m_use[:, None])
            lsum = lsum * alpha + p.sum(-1)
            m = m_new
            V = K[:, :D_V]
            bad = ~torch.isfinite(V) & dcols[:, None]  # non-finite V in draft rows of this block
            Vs = torch.where(bad, torch.zeros_like(V), V)
            pv = p.to(torch.bfloat16).float() @ Vs
            if bad.any():
                # NaN exactly where a row may see a non-finite V element
                hit = (vis.float() @ bad.float()) > 0
                pv = torch.where(hit, torch.full_like(pv, float("nan")), pv)
            acc = acc * alpha[:, None] + pv
        pos = lsum > 0
        inv = torch.where(
            pos,
            1.0 / torch.where(pos, lsum, torch.ones_like(lsum)),
            torch.where(torch.isnan(lsum), lsum, torch.zeros_like(lsum)),
        )
        out[q0:q1] = (acc * inv[:, None]).reshape(T, H, D_V).to(torch.bfloat16)
        l2 = torch.where(
            pos,
            m + torch.log2(torch.where(pos, lsum, torch.ones_like(lsum))),
            torch.where(torch.isnan(lsum), lsum, torch.full_like(lsum, float("-inf"))),
        )
        lse_out[q0:q1] = (l2 * math.log(2.0)).reshape(T, H)
    return (out, lse_out) if return_lse else out
