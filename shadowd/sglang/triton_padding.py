# mypy: allow-untyped-defs
""":func:`shadowd.sglang.padding.graph_shape` in one Triton launch (the CUDA path).

The torch version is some fifteen small kernels; captured into SGLang's decode graph they ran on every replay,
~18 µs per target-verify step on an H100 (bench/results/hook-2026-12-07.md, session 31). This is one program of
four warps: it counts the real token rows, then the real requests and their longest prefix, and writes the four
words. Its loops run over the captured batch (``bs`` and ``rows`` are the graph's constants), so the launch
configuration never depends on a replay's data, and one compilation (per metadata dtypes) serves every batch
size. Exactly the torch version's results (the tests compare them, under the interpreter and on the GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["graph_shape_fused"]

#: lanes per loop iteration (token rows / requests): a decode graph's rows (≤ 1024: e.g. 64 requests × 16 drafts)
#: in one
BLOCK = 1024
_NO_PREFIX = tl.constexpr(-(2**62))  # below any prefix length: the maximum over all requests when none is masked


@triton.jit(do_not_specialize=["bs", "draft", "rows"])  # one compilation for every batch, 1 included
def _graph_shape_kernel(qo_ptr, kv_ptr, loc_ptr, meta_ptr, bs, draft, rows, HAS_LOC: tl.constexpr,
                        BLOCK: tl.constexpr):
    lanes = tl.arange(0, BLOCK)
    n_tok = tl.zeros([BLOCK], dtype=tl.int64)
    # (while loops: Triton 3.6's interpreter cannot range() over a runtime argument with numpy >= 2.4)
    if HAS_LOC:
        start = 0
        while start < rows:
            r = start + lanes
            loc = tl.load(loc_ptr + r, mask=r < rows, other=0)
            n_tok += (loc != 0).to(tl.int64)
            start += BLOCK
    n_req = tl.zeros([BLOCK], dtype=tl.int64)
    longest = tl.full([BLOCK], _NO_PREFIX, dtype=tl.int64)
    start = 0
    while start < bs:
        i = start + lanes
        start += BLOCK
        inb = i < bs
        k0 = tl.load(kv_ptr + i, mask=inb, other=0).to(tl.int64)
        k1 = tl.load(kv_ptr + i + 1, mask=inb, other=0).to(tl.int64)
        if HAS_LOC:
            q0 = tl.load(qo_ptr + i, mask=inb, other=0).to(tl.int64)
            q1 = tl.load(qo_ptr + i + 1, mask=inb, other=0).to(tl.int64)
            first = tl.minimum(tl.maximum(q0, 0), rows - 1)  # clamped: a padded request may have no row
            first_loc = tl.load(loc_ptr + first, mask=inb, other=0)
            real = inb & (first_loc != 0) & (q1 > q0)
            n_req += real.to(tl.int64)
            longest = tl.maximum(longest, tl.where(real, k1 - k0, 0))
        else:
            longest = tl.maximum(longest, tl.where(inb, k1 - k0, _NO_PREFIX))
    if HAS_LOC:
        n_req_all = tl.sum(n_req, axis=0)
        n_tok_all = tl.sum(n_tok, axis=0)
    else:  # every row and request is real
        n_req_all = bs + tl.zeros([], dtype=tl.int64)
        n_tok_all = rows + tl.zeros([], dtype=tl.int64)
    w = tl.arange(0, 4)
    words = tl.where(w == 0, n_req_all, tl.where(w == 1, draft + tl.zeros([], dtype=tl.int64),
                                                 tl.where(w == 2, tl.max(longest, axis=0), n_tok_all)))
    tl.store(meta_ptr + w, words)


def graph_shape_fused(qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, out_cache_loc: torch.Tensor | None,
                      bs: int, draft: int, rows: int) -> torch.Tensor:
    """:func:`shadowd.sglang.padding.graph_shape` in one launch, for ``rows >= 1`` (its arguments, checked
    there). ``qo_indptr`` / ``kv_indptr`` hold at least ``bs + 1`` entries and ``out_cache_loc`` at least
    ``rows``; each is read through its first stride-1 elements, so they are made contiguous views if needed."""
    dev = kv_indptr.device
    meta = torch.empty(4, dtype=torch.int64, device=dev)
    kv = kv_indptr[: bs + 1].contiguous()
    has_loc = out_cache_loc is not None
    qo = qo_indptr[: bs + 1].contiguous() if has_loc else kv
    loc = out_cache_loc[:rows].contiguous() if out_cache_loc is not None else kv
    # one configuration for every batch: a capture of another size compiles nothing (the first call compiled it)
    _graph_shape_kernel[(1,)](qo, kv, loc, meta, bs, draft, rows, HAS_LOC=has_loc, BLOCK=BLOCK, num_warps=4)
    return meta
