"""The real requests of a target-verify step replayed from SGLang's decode CUDA graph, read on the device.

A graph is captured for a fixed batch size; a step with fewer requests replays the graph of the next captured
size, padded. Python does not run on replay, so the batch the hook records and the rows its statistics cover
must come from device memory the replay fills. In SGLang 0.5.23 the graph's input buffers are reset on every
replay by the buffer registry's padding policy (``cuda_graph_buffer_registry``): the padded tail of
``out_cache_loc`` is zeroed, the padded ``seq_lens`` hold the backend's fill value (1 for the Triton backend) and
``req_pool_indices`` are zeroed. KV slot 0 is SGLang's padding dummy, never given to a real token, so a token is
real exactly when its ``out_cache_loc`` is not 0, and a request is real when its first draft token is.

:func:`graph_shape` turns that into one small device tensor per forward, made inside the capture (so every
replay recomputes it) without a host synchronisation, in one Triton launch on the GPU
(:mod:`shadowd.sglang.triton_padding`; the torch ops here are the CPU path and its reference):

* ``[0]`` real requests (0 for a replay that only pads, e.g. an idle data-parallel rank: such a call publishes
  no sample);
* ``[1]`` draft tokens per request (the step's constant);
* ``[2]`` the longest prefix among the real requests;
* ``[3]`` real token rows (the padded ones follow them): the statistics and the candidate's non-finite check
  cover these only.

Draft tokens per request are the step's constant here. SGLang 0.5.23 replays a verify graph only for a batch of
the captured width (another width runs eagerly), and captures per-request verify lengths (the DSPARK ragged verify
layout) only for backends that declare ``supports_ragged_verify_graph``, which the Triton backend this hook wraps
does not.
"""

from __future__ import annotations

import torch

__all__ = ["META_FIELDS", "graph_shape", "graph_shape_torch", "warm_graph_shape"]

#: what each element of :func:`graph_shape`'s tensor holds
META_FIELDS = ("batch_size", "draft_tokens", "prefix_len", "valid_rows")

# (device, dtypes of qo_indptr / kv_indptr / out_cache_loc) whose fused kernel has been compiled
_WARMED: set[tuple[object, ...]] = set()


def warm_graph_shape(qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, out_cache_loc: torch.Tensor | None) -> None:
    """Compile the fused kernel for these metadata tensors' device and dtypes before a capture needs it: one
    launch over their first request and row, once per kind (an eager call's, so a compilation never happens
    inside SGLang's graph capture). A no-op on CPU, during a capture, and for tensors too short to read."""
    # called on every eager step: once warmed, a tuple and a set lookup decide (no query of the CUDA runtime)
    key = (kv_indptr.device, qo_indptr.dtype, kv_indptr.dtype, None if out_cache_loc is None else out_cache_loc.dtype)
    if key in _WARMED or not kv_indptr.is_cuda:
        return
    if torch.cuda.is_current_stream_capturing() or qo_indptr.numel() < 2 or kv_indptr.numel() < 2 or (
            out_cache_loc is not None and out_cache_loc.numel() < 1):
        return
    graph_shape(qo_indptr, kv_indptr, out_cache_loc, 1, 1, 1)
    _WARMED.add(key)


def graph_shape(qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, out_cache_loc: torch.Tensor | None, bs: int,
                draft: int, rows: int) -> torch.Tensor:
    """``int64 [real requests, draft, longest real prefix, real token rows]`` on ``kv_indptr``'s device.

    ``qo_indptr`` / ``kv_indptr``: the verify metadata's (at least ``bs + 1`` entries); ``out_cache_loc``: the
    step's KV write slots, one per token row (``None``: every row is taken as real); ``bs``: the captured
    (padded) batch size; ``draft``: draft tokens per request; ``rows``: token rows of the call. Capturable: no
    host reads, no host-to-device copies. One kernel on a CUDA device; :func:`graph_shape_torch` elsewhere.
    """
    if bs < 1 or rows < 0:
        raise ValueError(f"graph_shape: bs must be >= 1 and rows >= 0, got bs={bs}, rows={rows}")
    if kv_indptr.is_cuda and rows:
        from shadowd.sglang.triton_padding import graph_shape_fused

        return graph_shape_fused(qo_indptr, kv_indptr, out_cache_loc, bs, draft, rows)
    return graph_shape_torch(qo_indptr, kv_indptr, out_cache_loc, bs, draft, rows)


def graph_shape_torch(qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, out_cache_loc: torch.Tensor | None,
                      bs: int, draft: int, rows: int) -> torch.Tensor:
    """:func:`graph_shape` in torch ops (some fifteen kernels on a GPU): the CPU path and the fused kernel's
    reference. Arguments as there, checked there."""
    dev = kv_indptr.device
    kvp = kv_indptr[: bs + 1].to(torch.int64)
    lens = kvp[1:] - kvp[:-1]
    meta = torch.empty(4, dtype=torch.int64, device=dev)
    meta[1:2].fill_(draft)  # fill_ takes the scalar as a kernel argument: no host-to-device copy
    if out_cache_loc is None or rows == 0:
        meta[0:1].fill_(bs if rows else 0)
        meta[3:4].fill_(rows)
        if rows:
            meta[2:3] = lens.amax(dim=0, keepdim=True)
        else:
            meta[2:3].fill_(0)
        return meta
    loc = out_cache_loc[:rows]
    real_tok = loc != 0
    qo = qo_indptr[: bs + 1].to(torch.int64)
    first = qo[:-1].clamp(0, rows - 1)  # a request's first token row (clamped: a padded request may have none)
    real_req = real_tok[first] & (qo[1:] > qo[:-1])
    meta[0:1] = real_req.sum(dim=0, keepdim=True)
    meta[2:3] = torch.where(real_req, lens, torch.zeros_like(lens)).amax(dim=0, keepdim=True)
    meta[3:4] = real_tok.sum(dim=0, keepdim=True)
    return meta
