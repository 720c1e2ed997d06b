"""mla_tree_verify: MLA tree-verify attention kernel (CUDA, sm_120 + sm_90) for SGLang target verify.

Entry point: :func:`tree_verify`.  The CUDA library is compiled with nvcc on first use (never at
``pip install``); see :mod:`mla_tree_verify.build` and :mod:`mla_tree_verify.compile_check`.
The float64/float32 oracle lives in :mod:`mla_tree_verify.oracle`, a second (blockwise, bf16-in)
CPU implementation in :mod:`mla_tree_verify.reference`, case generators in
:mod:`mla_tree_verify.testing`.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any

from ._checks import ArgumentError, validate_args

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "D_QK",
    "D_V",
    "ERROR_BITS",
    "ArgumentError",
    "block_m",
    "choose_num_splits",
    "decode_error_flag",
    "tree_verify",
    "validate_args",
    "workspace_size",
]

D_QK = 576
D_V = 512
BLOCK_M = 64  # query rows per CTA (what mtv_block_m() of the library reports)
MAX_SPLITS = 256  # = MAX_SPLITS in csrc/common/tree_verify_kernel.cuh (one CTA per SM: >= the SM count)
MIN_KV_PER_SPLIT = 128

# Bits of the int32 error flag (OR-ed in by the kernel; the caller clears it).
ERROR_BITS = {
    1: "kv_indices entry outside [0, num_slots): the slot was clamped",
    2: "a request has more than max_q_len * heads query rows: extra rows were not computed",
    4: "qo_indptr / kv_indptr inconsistent (negative, decreasing or out of range): request skipped",
    8: "custom_mask index past its end: treated as invisible",
}


def decode_error_flag(value: int) -> list[str]:
    """Human-readable meanings of the bits set in an error-flag value."""
    return [msg for bit, msg in ERROR_BITS.items() if value & bit]


@functools.cache
def block_m() -> int:
    """Query rows per CTA of the built library (``mtv_block_m()``, a compile-time constant, asked once);
    builds and loads it if needed."""
    from . import _lib

    return int(_lib.load().mtv_block_m())


def choose_num_splits(batch: int, max_q_len: int, heads: int, kv_len_hint: int, sm_count: int = 132,
                      block_m: int = BLOCK_M) -> int:
    """KV splits per (request, row tile), from shapes only (static under CUDA-graph replay).

    ``block_m`` is the library's query rows per CTA (:func:`block_m`; BLOCK_M without a library).

    The kernel runs one 256-thread CTA per SM (registers), so aim for one full wave of
    ``sm_count`` CTAs, with at least MIN_KV_PER_SPLIT KV rows per split on average
    (``kv_len_hint`` = average prefix + tree length; an over-estimate only costs speed).
    """
    m_tiles = max(1, math.ceil(max_q_len * heads / block_m))
    base = max(1, batch * m_tiles)
    s = sm_count // base
    s = min(s, max(1, math.ceil(kv_len_hint / MIN_KV_PER_SPLIT)), MAX_SPLITS)
    return max(1, s)


def workspace_size(max_batch: int, max_total_tokens: int, heads: int, num_splits: int = MAX_SPLITS) -> int:
    """Workspace bytes (fp32 split partials) for up to ``num_splits`` KV splits.

    = num_splits * max_total_tokens * heads * (512 + 1) * 4; zero when ``num_splits <= 1``.
    ``max_batch`` is part of the declared maxima but does not change the size.  Size a CUDA-graph
    workspace with the ``num_splits`` you will pass (or MAX_SPLITS to cover any choice).
    """
    del max_batch
    if num_splits <= 1:
        return 0
    return num_splits * max_total_tokens * heads * (D_V + 1) * 4


_SM_COUNT: dict[int, int] = {}


def _sm_count(device: Any) -> int:
    import torch

    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def _current_stream(q: torch.Tensor) -> int:
    """The raw handle of q's device's current stream. torch's raw-stream query (the one Triton's launcher uses)
    costs well under a microsecond; ``torch.cuda.current_stream(device)`` builds a Stream object (several µs of host
    time per call), so it is only the fallback where the query is missing."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return int(raw(q.get_device()))
    return int(torch.cuda.current_stream(q.device).cuda_stream)


def _whole(value: Any, name: str, lo: int, hi: int | None, what: str) -> int:
    """An integer argument in [lo, hi] (any integer type but bool), else ArgumentError naming it."""
    import operator

    try:
        v = operator.index(value) if not isinstance(value, bool) else None
    except TypeError:
        v = None
    if v is None or v < lo or (hi is not None and v > hi):
        bounds = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ArgumentError(name, f"expected a whole number {bounds} ({what}), got {value!r}")
    return int(v)


def tree_verify(
    q: torch.Tensor,
    k_draft: torch.Tensor,
    kv_buffer: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    custom_mask: torch.Tensor | None,
    mask_indptr: torch.Tensor | None,
    sm_scale: float,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    error_flag: torch.Tensor | None = None,
    max_q_len: int | None = None,
    num_splits: int | None = None,
    nonfinite_flag: torch.Tensor | None = None,
) -> torch.Tensor:
    """MLA tree-verify attention (SGLang target-verify layout), one launch (+ combine).

    For request b (prefix length L_b, T_b draft tokens), every draft row sees the whole prefix;
    among drafts, row i sees column j iff ``custom_mask`` says so (FULL_MASK), or j <= i when
    ``custom_mask`` is None.  softmax(sm_scale * q.k) over visible columns, times v (= k[:512]).

    Args (ΣT = total draft tokens of the batch, B = batch, H = heads, N = KV slots):
        q:           bf16 [ΣT, H, 576], CUDA, last dim contiguous (absorbed q: 512 nope + 64 rope).
        k_draft:     bf16 [ΣT, 1, 576] (or [ΣT, 576]), the draft tokens' latent k; v = its first 512.
        kv_buffer:   bf16 [N, 1, 576] (or [N, 576]), the layer's latent KV cache (prefix rows only read).
        qo_indptr:   int32/int64 [B+1], draft-token offsets of each request (T_b = diff).
        kv_indptr:   int32/int64 [B+1], offsets into kv_indices (L_b = diff; prefix only).
        kv_indices:  int32/int64 [>= kv_indptr[B]], slot ids of the prefix rows (scattered).
        custom_mask: bool/uint8, 1-D flattened FULL_MASK: request b has T_b rows x (L_b+T_b) columns,
                     row-major, starting at mask_indptr[b]; prefix columns are ignored.  None = causal.
        mask_indptr: int32/int64 [B+1], required with custom_mask (ignored without).
        sm_scale:    softmax scale (MLA: 192**-0.5 times mscale**2 - not 576**-0.5).
        out:         optional bf16 [ΣT, H, 512] output (last dim contiguous); allocated if None.
        lse:         optional fp32 [ΣT, H]: natural-log sum-exp of the scaled visible logits.
        workspace:   optional CUDA tensor (any dtype) of >= workspace_size(B, ΣT, H, num_splits) bytes;
                     allocated if needed and None (pass one when capturing CUDA graphs).
        error_flag:  optional int32 [1] CUDA tensor; bits are OR-ed in (see ERROR_BITS), never cleared.
        max_q_len:   upper bound of T_b (default ΣT); launch shape depends on it, not on device data.  The grid
                     holds ceil(max_q_len * H / 64) <= 65535 row tiles (and B <= 65535 requests): pass it
                     when ΣT * H is larger (ΣT 32768 at H 128, say).
        num_splits:  KV splits (default: choose_num_splits from shapes; reduced to fit ``workspace``).
        nonfinite_flag: optional int32 [1] CUDA tensor, set to 1 when an element written to ``out`` is NaN or
                     +-Inf (what the inputs give - a NaN in a visible KV row, say - not an argument error; a
                     caller may compare such a call against a reference), never cleared.

    Returns ``out`` (ΣT = 0 or B = 0: nothing is launched).  Host-side checks only (dtype, device, shape,
    strides): no device reads, no synchronisation, so the call is CUDA-graph capturable given static
    ``out``/``workspace``.
    """
    import torch

    from . import _lib

    # the launch's integers (max_q_len 0 launched nothing and left `out` unwritten; num_splits out of range was
    # clamped silently)
    if max_q_len is not None:
        max_q_len = _whole(max_q_len, "max_q_len", 1, 2**31 - 1, "an upper bound of every request's draft tokens")
    if num_splits is not None:
        num_splits = _whole(num_splits, "num_splits", 1, MAX_SPLITS, "KV splits per (request, row tile)")
    validate_args(
        q,
        k_draft,
        kv_buffer,
        qo_indptr,
        kv_indptr,
        kv_indices,
        custom_mask,
        mask_indptr,
        sm_scale,
        out,
        lse,
        workspace,
        error_flag,
        require_cuda=True,
        nonfinite_flag=nonfinite_flag,
    )
    total_tokens, heads = q.shape[0], q.shape[1]
    batch = qo_indptr.shape[0] - 1
    if max_q_len is None:
        max_q_len = total_tokens
    if out is None:
        out = torch.empty((total_tokens, heads, D_V), dtype=torch.bfloat16, device=q.device)
    if total_tokens == 0 or batch == 0:  # nothing to compute (empty tensors' pointers may be NULL: no launch)
        return out
    # the grid: one CTA row per BM query rows of the longest request, one CTA layer per request (CUDA's 65535)
    if batch > 65535:
        raise ArgumentError("qo_indptr", f"{batch} requests in one call: at most 65535")
    if -(-max_q_len * heads // block_m()) > 65535:
        raise ArgumentError("max_q_len", f"max_q_len {max_q_len} x {heads} heads is more than 65535 tiles of "
                                         f"{block_m()} query rows: pass max_q_len, the longest request's draft tokens"
                                         " (it defaults to every request's together)")
    if num_splits is None:
        hint = kv_indices.shape[0] // max(batch, 1) + max_q_len
        num_splits = choose_num_splits(batch, max_q_len, heads, hint, _sm_count(q.device), block_m())
    num_splits = max(1, min(int(num_splits), MAX_SPLITS))
    if workspace is not None:
        cap = workspace.numel() * workspace.element_size()
        while num_splits > 1 and workspace_size(batch, total_tokens, heads, num_splits) > cap:
            num_splits -= 1
    elif num_splits > 1:
        workspace = torch.empty(
            workspace_size(batch, total_tokens, heads, num_splits), dtype=torch.uint8, device=q.device
        )
    _lib.launch(
        q,
        k_draft,
        kv_buffer,
        qo_indptr,
        kv_indptr,
        kv_indices,
        custom_mask,
        mask_indptr,
        float(sm_scale),
        out,
        lse,
        workspace,
        error_flag,
        batch,
        total_tokens,
        heads,
        int(max_q_len),
        num_splits,
        _current_stream(q),
        nonfinite_flag,
    )
    return out
