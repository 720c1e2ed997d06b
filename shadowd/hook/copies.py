"""The candidate's private copies of its inputs under graph capture, in one launch (:func:`clone_many`).

A captured call gives the candidate copies of its small inputs (``ShadowSite._protect``), and every copy made
one by one is a graph node of its own that each replay pays (~1–1.5 µs on the H200). Here the inputs become
pieces of one ``torch._foreach_copy_`` over int32 views: each dense input whose bytes are whole 4-byte words is
cut into pieces of :data:`PIECE_BYTES` (the foreach gives each piece of its list to one thread block, so a
512 KB mask is copied by eight blocks at once, not one looping block), and a view of such an input (SGLang's
``v``, the first 512 columns of the draft ``k``) becomes the same view of its copy. What fits neither (an
odd-length byte mask, a view of nothing copied) is cloned on its own. Eager calls keep a clone per input: there
the host's time is what a call waits for, and the views here cost it more (bench/results/hook-2026-11-30.md).
"""

from __future__ import annotations

import torch

__all__ = ["PIECE_BYTES", "clone_many"]

#: the size of the pieces the inputs are cut into (a thread block each)
PIECE_BYTES = 1 << 16


def _words(x: torch.Tensor) -> bool:
    # dense, contiguous, whole 4-byte words, at a word-aligned offset: viewable as int32
    nbytes, esize = x.numel() * x.element_size(), x.element_size()
    return nbytes > 0 and nbytes % 4 == 0 and x.is_contiguous() and x.storage_offset() * esize % 4 == 0


def _span(x: torch.Tensor) -> tuple[int, int]:
    # the first and last element offsets (in elements of x's storage) that x reads
    if any(s < 0 for s in x.stride()):
        return -1, -1
    first = int(x.storage_offset())
    return first, first + sum((int(n) - 1) * int(s) for n, s in zip(x.shape, x.stride(), strict=True))


def _holder(x: torch.Tensor, xs: list[torch.Tensor], copied: list[bool]) -> int | None:
    # the index of a copied contiguous input of x's dtype whose memory holds all of x's elements
    if x.numel() == 0:
        return None
    first, last = _span(x)
    ptr = x.untyped_storage().data_ptr()
    for j, y in enumerate(xs):
        if (copied[j] and y.dtype == x.dtype and y.untyped_storage().data_ptr() == ptr
                and y.storage_offset() <= first and last < y.storage_offset() + y.numel()):
            return j
    return None


def clone_many(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Private copies of ``xs``: equal values, dtype and shape; new memory (a view of a copied input is the same
    view of its copy, so its strides are the input's; any other copy is like ``x.detach().clone()``). The
    copies of word-sized dense inputs are one ``torch._foreach_copy_`` (more than one launch only past its
    limits: 64 pieces, i.e. 4 MB of inputs)."""
    xs = [x.detach() for x in xs]
    out: list[torch.Tensor | None] = [None] * len(xs)
    srcs: list[torch.Tensor] = []
    dsts: list[torch.Tensor] = []
    step = PIECE_BYTES // 4
    for i, x in enumerate(xs):
        if _words(x):
            y = torch.empty_like(x)
            xw, yw = x.view(-1).view(torch.int32), y.view(-1).view(torch.int32)
            for s in range(0, xw.numel(), step):
                srcs.append(xw[s:s + step])
                dsts.append(yw[s:s + step])
            out[i] = y
    copied = [y is not None for y in out]
    done: list[torch.Tensor] = []
    for i, x in enumerate(xs):
        c = out[i]
        if c is None:
            j = _holder(x, xs, copied)
            base = out[j] if j is not None else None
            if j is None or base is None:
                c = x.clone()
            else:  # the same view of the holder's copy
                offset = base.storage_offset() + x.storage_offset() - xs[j].storage_offset()
                c = base.as_strided(x.shape, x.stride(), offset)
        done.append(c)
    if srcs:
        torch._foreach_copy_(dsts, srcs)
    return done
