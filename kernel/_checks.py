"""Host-side argument checks of :func:`mla_tree_verify.tree_verify`.

Only tensor metadata is read (dtype, device, shape, strides) - never tensor data, which would
synchronise with the device and break CUDA-graph capture.  Every failure names the argument.
With ``require_cuda=False`` the device check is skipped, so the checks run on CPU tensors.
"""

from __future__ import annotations

import functools
import math
import numbers
import struct
from collections.abc import Callable
from typing import Any

INDEX_DTYPES = ("torch.int32", "torch.int64")
MASK_DTYPES = ("torch.bool", "torch.uint8")


#: the smallest and largest float64 values that stay positive and finite in float32 (the fast path's bounds; the
#: smallest positive subnormal rounds up from just above half of it)
_F32_MIN, _F32_MAX = 2.0**-149, 3.4028234663852886e38


class ArgumentError(ValueError):
    """A tree_verify argument is unusable; ``.argument`` names it."""

    def __init__(self, argument: str, message: str):
        super().__init__(f"mla_tree_verify.tree_verify: argument '{argument}': {message}")
        self.argument = argument


def scale_ok(x: object) -> bool:
    """``sm_scale``: a real number (numpy scalars too; not a bool) that is finite and positive as the kernel's
    float32 takes it (1e300 would be inf there, 1e-60 zero)."""
    if not isinstance(x, numbers.Real) or isinstance(x, bool):
        return False
    try:
        f32 = struct.unpack("f", struct.pack("f", float(x)))[0]
    except (OverflowError, ValueError):  # (beyond float64, or beyond float32's range)
        return False
    return math.isfinite(f32) and f32 > 0


def _need(cond: bool, name: str, msg: str | Callable[[], str]) -> None:
    # a message that shows values is passed as a callable: it is formatted only when the check fails (the checks
    # run on every call: formatting every message eagerly cost ~30 µs of host time per call)
    if not cond:
        raise ArgumentError(name, msg if isinstance(msg, str) else msg())


def _tensor(x: Any, name: str) -> None:
    import torch

    if not isinstance(x, torch.Tensor):
        raise ArgumentError(name, f"expected a torch.Tensor, got {type(x).__name__}")


@functools.cache
def _dtypes(allowed: tuple[str, ...]) -> frozenset[Any]:
    import torch

    return frozenset(getattr(torch, a.removeprefix("torch.")) for a in allowed)


def _dtype(x: Any, name: str, allowed: tuple[str, ...]) -> None:
    if x.dtype not in _dtypes(allowed):
        raise ArgumentError(name, f"dtype {x.dtype} not in {allowed}")


def _index(x: Any, name: str, length: int | None = None) -> None:
    _tensor(x, name)
    _dtype(x, name, INDEX_DTYPES)
    _need(x.dim() == 1, name, lambda: f"expected 1-D, got shape {tuple(x.shape)}")
    if length is not None:
        _need(x.shape[0] == length, name, lambda: f"expected length {length}, got {x.shape[0]}")
    _need(x.shape[0] <= 1 or x.stride(0) == 1, name, "must be contiguous")


def _rows576(x: Any, name: str, d: int) -> int:
    """[R, 1, d] or [R, d] with a contiguous last dim; returns R."""
    _tensor(x, name)
    _dtype(x, name, ("torch.bfloat16",))
    ok = (x.dim() == 3 and x.shape[1] == 1 and x.shape[2] == d) or (x.dim() == 2 and x.shape[1] == d)
    _need(ok, name, lambda: f"expected shape [rows, 1, {d}] or [rows, {d}], got {tuple(x.shape)}")
    _need(x.stride(-1) == 1, name, "last dim must be contiguous (stride 1)")
    _need(x.stride(0) % 8 == 0, name, lambda: f"row stride {x.stride(0)} must be a multiple of 8 elements (16 B)")
    return x.shape[0]


def _accepts(q, k_draft, kv_buffer, qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr, sm_scale, out, lse,
             workspace, error_flag, nonfinite_flag, require_cuda) -> bool:
    """Every condition of :func:`validate_args`, inline (no helper calls, no messages): True only when the labelled
    checks would pass too; on False they run and name what is wrong.  An eager call pays these checks on every
    launch, so the common case is kept to attribute reads and comparisons (~2.5x faster than the labelled checks;
    ``tests/kernel/test_checks_cpu.py`` holds the two to the same answers)."""

    import torch

    t = torch.Tensor
    bf16 = torch.bfloat16
    index_dtypes = _dtypes(INDEX_DTYPES)
    try:
        if not isinstance(q, t) or q.dtype != bf16 or q.dim() != 3:
            return False
        total, heads, d = q.shape
        qs = q.stride()
        if d != 576 or heads < 1 or qs[2] != 1 or qs[0] % 8 or qs[1] % 8:
            return False
        for x, need_rows in ((k_draft, total), (kv_buffer, -1)):
            if not isinstance(x, t) or x.dtype != bf16:
                return False
            shp = x.shape
            if not ((len(shp) == 3 and shp[1] == 1 and shp[2] == 576) or (len(shp) == 2 and shp[1] == 576)):
                return False
            xs = x.stride()
            if xs[-1] != 1 or xs[0] % 8 or (shp[0] != need_rows if need_rows >= 0 else shp[0] < 1):
                return False
        if not isinstance(qo_indptr, t) or qo_indptr.dim() != 1 or qo_indptr.shape[0] < 1:
            return False
        batch1 = qo_indptr.shape[0]
        idx = [(qo_indptr, -1), (kv_indptr, batch1), (kv_indices, -1)]
        if custom_mask is not None:
            if (not isinstance(custom_mask, t) or custom_mask.dtype not in _dtypes(MASK_DTYPES)
                    or custom_mask.dim() != 1 or (custom_mask.shape[0] > 1 and custom_mask.stride(0) != 1)):
                return False
            idx.append((mask_indptr, batch1))
        for x, length in idx:
            if (not isinstance(x, t) or x.dtype not in index_dtypes or x.dim() != 1
                    or (length >= 0 and x.shape[0] != length) or (x.shape[0] > 1 and x.stride(0) != 1)):
                return False
        if not (_F32_MIN <= sm_scale <= _F32_MAX if type(sm_scale) is float else scale_ok(sm_scale)):
            return False
        if out is not None:
            if not isinstance(out, t) or out.dtype != bf16 or tuple(out.shape) != (total, heads, 512):
                return False
            os_ = out.stride()
            if os_[2] != 1 or os_[0] % 2 or os_[1] % 2 or (total > 1 and os_[0] == 0) or (heads > 1 and os_[1] == 0):
                return False
        if lse is not None:
            if not isinstance(lse, t) or lse.dtype != torch.float32 or tuple(lse.shape) != (total, heads):
                return False
            ls = lse.stride()
            if (total > 1 and ls[0] == 0) or (heads > 1 and ls[1] == 0):
                return False
        if workspace is not None and (not isinstance(workspace, t) or not workspace.is_contiguous()
                                      or workspace.data_ptr() % 16):
            return False
        for flag in (error_flag, nonfinite_flag):
            if flag is not None and (not isinstance(flag, t) or flag.dtype != torch.int32 or flag.numel() < 1):
                return False
        tensors = (q, k_draft, kv_buffer, qo_indptr, kv_indptr, kv_indices, custom_mask,
                   mask_indptr if custom_mask is not None else None, out, lse, workspace, error_flag, nonfinite_flag)
        if require_cuda:
            if not q.is_cuda:
                return False
            dev = q.get_device()
            for x in tensors:
                if x is not None and (not x.is_cuda or x.get_device() != dev):
                    return False
        for x in (q, k_draft, kv_buffer, out):
            if x is not None and x.numel() > 0 and x.data_ptr() % 16:
                return False
    except Exception:  # anything unexpected (an object posing as a tensor, say): the labelled checks decide
        return False
    return True


def validate_args(
    q,
    k_draft,
    kv_buffer,
    qo_indptr,
    kv_indptr,
    kv_indices,
    custom_mask,
    mask_indptr,
    sm_scale,
    out=None,
    lse=None,
    workspace=None,
    error_flag=None,
    require_cuda: bool = True,
    nonfinite_flag=None,
) -> None:
    """Raise :class:`ArgumentError` naming the first unusable argument."""
    if not _accepts(q, k_draft, kv_buffer, qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr, sm_scale, out,
                    lse, workspace, error_flag, nonfinite_flag, require_cuda):
        _labelled(q, k_draft, kv_buffer, qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr, sm_scale, out,
                  lse, workspace, error_flag, nonfinite_flag, require_cuda)


def _labelled(q, k_draft, kv_buffer, qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr, sm_scale, out, lse,
              workspace, error_flag, nonfinite_flag, require_cuda) -> None:
    """The checks one by one, each naming its argument (what :func:`validate_args` runs when :func:`_accepts`
    does not accept)."""

    _tensor(q, "q")
    _dtype(q, "q", ("torch.bfloat16",))
    _need(
        q.dim() == 3 and q.shape[2] == 576, "q", lambda: f"expected shape [tokens, heads, 576], got {tuple(q.shape)}"
    )
    _need(q.shape[1] >= 1, "q", "needs at least one head")
    _need(q.stride(2) == 1, "q", "last dim must be contiguous (stride 1)")
    _need(
        q.stride(0) % 8 == 0 and q.stride(1) % 8 == 0,
        "q",
        lambda: f"token/head strides {q.stride()[:2]} must be multiples of 8 elements (16 B)",
    )
    total, heads = q.shape[0], q.shape[1]
    n_draft = _rows576(k_draft, "k_draft", 576)
    _need(n_draft == total, "k_draft", lambda: f"expected {total} rows (one per q token), got {n_draft}")
    _rows576(kv_buffer, "kv_buffer", 576)
    _need(kv_buffer.shape[0] >= 1, "kv_buffer", "needs at least one slot")
    _index(qo_indptr, "qo_indptr")
    _need(qo_indptr.shape[0] >= 1, "qo_indptr", "needs batch+1 >= 1 entries")
    batch = qo_indptr.shape[0] - 1
    _index(kv_indptr, "kv_indptr", batch + 1)
    _index(kv_indices, "kv_indices")
    if custom_mask is not None:
        _tensor(custom_mask, "custom_mask")
        _dtype(custom_mask, "custom_mask", MASK_DTYPES)
        _need(
            custom_mask.dim() == 1,
            "custom_mask",
            lambda: f"expected flattened 1-D, got shape {tuple(custom_mask.shape)}",
        )
        _need(custom_mask.shape[0] <= 1 or custom_mask.stride(0) == 1, "custom_mask", "must be contiguous")
        _need(mask_indptr is not None, "mask_indptr", "required when custom_mask is given")
        _index(mask_indptr, "mask_indptr", batch + 1)
    _need(scale_ok(sm_scale), "sm_scale",
          lambda: f"expected a finite positive real number (in float32, as the kernel takes it), got {sm_scale!r}")
    if out is not None:
        _tensor(out, "out")
        _dtype(out, "out", ("torch.bfloat16",))
        _need(
            tuple(out.shape) == (total, heads, 512),
            "out",
            lambda: f"expected shape {(total, heads, 512)}, got {tuple(out.shape)}",
        )
        _need(out.stride(2) == 1, "out", "last dim must be contiguous (stride 1)")
        _need(out.stride(0) % 2 == 0 and out.stride(1) % 2 == 0, "out", "token/head strides must be even")
        _need((total <= 1 or out.stride(0) != 0) and (heads <= 1 or out.stride(1) != 0), "out",
              "a stride of 0 (an expanded tensor) would make rows share their elements")
    if lse is not None:
        _tensor(lse, "lse")
        _dtype(lse, "lse", ("torch.float32",))
        _need(
            tuple(lse.shape) == (total, heads),
            "lse",
            lambda: f"expected shape {(total, heads)}, got {tuple(lse.shape)}",
        )
        _need((total <= 1 or lse.stride(0) != 0) and (heads <= 1 or lse.stride(1) != 0), "lse",
              "a stride of 0 (an expanded tensor) would make rows share their elements")
    if workspace is not None:
        _tensor(workspace, "workspace")
        _need(workspace.is_contiguous(), "workspace", "must be contiguous")
        _need(workspace.data_ptr() % 16 == 0, "workspace", "must be 16-byte aligned")
    for flag, flag_name in ((error_flag, "error_flag"), (nonfinite_flag, "nonfinite_flag")):
        if flag is not None:
            _tensor(flag, flag_name)
            _dtype(flag, flag_name, ("torch.int32",))
            _need(flag.numel() >= 1, flag_name, "needs at least one element")
    tensors = {
        "q": q,
        "k_draft": k_draft,
        "kv_buffer": kv_buffer,
        "qo_indptr": qo_indptr,
        "kv_indptr": kv_indptr,
        "kv_indices": kv_indices,
        "custom_mask": custom_mask,
        "mask_indptr": mask_indptr if custom_mask is not None else None,
        "out": out,
        "lse": lse,
        "workspace": workspace,
        "error_flag": error_flag,
        "nonfinite_flag": nonfinite_flag,
    }
    if require_cuda:
        dev = q.get_device() if q.is_cuda else None  # (is_cuda and get_device() are cheap; .device builds an object)
        for name, t in tensors.items():
            if t is None or (t.is_cuda and t.get_device() == dev):
                continue
            if not t.is_cuda:
                raise ArgumentError(name, f"must be a CUDA tensor, got device {t.device}")
            raise ArgumentError(name, f"on {t.device}, but q is on {q.device}")
    for name in ("q", "k_draft", "kv_buffer", "out"):
        t = tensors[name]
        if t is not None and t.numel() > 0:
            _need(t.data_ptr() % 16 == 0, name, "data pointer must be 16-byte aligned")
