"""The oracle: MLA tree-verify attention in plain PyTorch at float64 (or float32).

Same contract as :func:`mla_tree_verify.tree_verify` (SGLang target-verify layout).  Per
request: the prefix is processed in chunks of ``chunk`` rows (gathered from the KV buffer through
kv_indices) and merged with a running max / sum, so memory stays bounded for 200k-token prefixes;
the draft columns are handled per draft row by gathering *only the visible rows* - a NaN/Inf in a
row a draft may not see never enters its arithmetic.  Runs on CPU or CUDA tensors (it reads the
index tensors on the host, so it synchronises; it is a reference, not a kernel).

Rows with no visible column (impossible with SGLang masks, which always include the diagonal)
give output 0 and LSE -inf.
"""

from __future__ import annotations

import torch

D_QK = 576
D_V = 512


def tree_visibility(custom_mask, mask_indptr, b: int, L: int, T: int, device) -> torch.Tensor:
    """[T, T] bool: draft row i sees draft column j (FULL_MASK slice, or causal when mask is None)."""
    if custom_mask is None:
        return torch.ones(T, T, dtype=torch.bool, device=device).tril()
    start = int(mask_indptr[b])
    m = custom_mask[start : start + T * (L + T)].reshape(T, L + T)[:, L:]
    return m.to(torch.bool).to(device)


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
    dtype=torch.float64,
    chunk: int = 4096,
    return_lse: bool = False,
):
    """Return out [ΣT, H, 512] in ``dtype`` (and LSE [ΣT, H] natural log when ``return_lse``)."""
    dev = q.device
    total, H = q.shape[0], q.shape[1]
    kv = kv_buffer.reshape(kv_buffer.shape[0], D_QK)
    kd = k_draft.reshape(k_draft.shape[0], D_QK)
    qo = [int(x) for x in qo_indptr.cpu()]
    kvp = [int(x) for x in kv_indptr.cpu()]
    out = torch.zeros(total, H, D_V, dtype=dtype, device=dev)
    lse = torch.full((total, H), float("-inf"), dtype=dtype, device=dev)
    for b in range(len(qo) - 1):
        q0, q1 = qo[b], qo[b + 1]
        T = q1 - q0
        if T <= 0:
            continue
        k0, k1 = kvp[b], kvp[b + 1]
        L = k1 - k0
        qb = q[q0:q1].to(dtype) * sm_scale  # [T, H, 576]
        m = torch.full((T, H), float("-inf"), dtype=dtype, device=dev)
        lsum = torch.zeros(T, H, dtype=dtype, device=dev)
        acc = torch.zeros(T, H, D_V, dtype=dtype, device=dev)

        def rescale(s_max):
            nonlocal m, lsum, acc
            m_new = torch.maximum(m, s_max)
            m_use = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
            alpha = torch.exp(m - m_use)
            m = m_new
            lsum = lsum * alpha
            acc = acc * alpha[..., None]
            return m_use

        for c0 in range(0, L, chunk):
            idx = kv_indices[k0 + c0 : k0 + min(L, c0 + chunk)].to(dev).long()
            K = kv[idx].to(dtype)  # every draft row sees every prefix row
            s = torch.einsum("thd,cd->thc", qb, K)
            m_use = rescale(s.amax(-1))
            p = torch.exp(s - m_use[..., None])
            lsum = lsum + p.sum(-1)
            acc = acc + torch.einsum("thc,cd->thd", p, K[:, :D_V])
        vis = tree_visibility(custom_mask, mask_indptr, b, L, T, dev)
        Kd = kd[q0:q1].to(dtype)
        for t in range(T):
            cols = vis[t].nonzero().flatten()
            if cols.numel() == 0:
                continue
            Kv = Kd[cols]  # only the visible draft rows
            s = qb[t] @ Kv.T  # [H, n]
            mt = torch.maximum(m[t], s.amax(-1))
            mu = torch.where(mt == float("-inf"), torch.zeros_like(mt), mt)
            alpha = torch.exp(m[t] - mu)
            p = torch.exp(s - mu[:, None])
            lsum[t] = lsum[t] * alpha + p.sum(-1)
            acc[t] = acc[t] * alpha[:, None] + p @ Kv[:, :D_V]
            m[t] = mt
        pos = lsum > 0
        safe = torch.where(pos, lsum, torch.ones_like(lsum))
        res = torch.where(pos[..., None], acc / safe[..., None], torch.zeros_like(acc))
        nan_l = torch.isnan(lsum)
        res = torch.where(nan_l[..., None], torch.full_like(acc, float("nan")), res)
        out[q0:q1] = res
        lse[q0:q1] = torch.where(pos, m + torch.log(safe), torch.where(nan_l, lsum, lse[q0:q1]))
    return (out, lse) if return_lse else out
