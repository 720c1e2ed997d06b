"""ctypes binding over the nvcc-built library (keeps ``pip install`` torch- and compiler-free)."""

from __future__ import annotations

import ctypes
import os
import threading

from ._build import build

_c_p = ctypes.c_void_p
_i64 = ctypes.c_int64
_i32 = ctypes.c_int32


class MtvArgs(ctypes.Structure):
    """Mirror of ``MtvArgs`` in csrc/common/mla_tree_verify.h (field order matters)."""

    _fields_ = [
        ("q", _c_p),
        ("q_s0", _i64),
        ("q_s1", _i64),
        ("k_draft", _c_p),
        ("kd_s0", _i64),
        ("kv_buffer", _c_p),
        ("kv_s0", _i64),
        ("num_slots", _i64),
        ("qo_indptr", _c_p),
        ("kv_indptr", _c_p),
        ("kv_indices", _c_p),
        ("custom_mask", _c_p),
        ("mask_indptr", _c_p),
        ("qo_is64", _i32),
        ("kvp_is64", _i32),
        ("kvi_is64", _i32),
        ("mp_is64", _i32),
        ("kv_indices_len", _i64),
        ("mask_len", _i64),
        ("o", _c_p),
        ("o_s0", _i64),
        ("o_s1", _i64),
        ("lse", _c_p),
        ("lse_s0", _i64),
        ("lse_s1", _i64),
        ("workspace", _c_p),
        ("workspace_floats", _i64),
        ("error_flag", _c_p),
        ("batch", _i32),
        ("total_tokens", _i32),
        ("heads", _i32),
        ("max_q_len", _i32),
        ("num_splits", _i32),
        ("sm_scale", ctypes.c_float),
        ("nonfinite_flag", _c_p),
    ]


_LIB: ctypes.CDLL | None = None
_LOCK = threading.Lock()


def load() -> ctypes.CDLL:
    """Build (if needed) and load the library; ``$MLA_TREE_VERIFY_LIB`` overrides the path."""
    global _LIB
    lib = _LIB
    if lib is not None:  # every launch after the first: no lock on the caller's (serving) thread
        return lib
    with _LOCK:
        if _LIB is None:
            path = os.environ.get("MLA_TREE_VERIFY_LIB") or str(build())
            lib = ctypes.CDLL(path)
            lib.mtv_tree_verify.argtypes = [ctypes.POINTER(MtvArgs), _c_p]
            lib.mtv_tree_verify.restype = ctypes.c_int
            lib.mtv_error_string.argtypes = [ctypes.c_int]
            lib.mtv_error_string.restype = ctypes.c_char_p
            lib.mtv_workspace_floats.argtypes = [_i32, _i32, _i32]
            lib.mtv_workspace_floats.restype = _i64
            lib.mtv_block_m.argtypes = []
            lib.mtv_block_m.restype = ctypes.c_int
            _LIB = lib
        return _LIB


def _is64(t) -> int:
    import torch

    return 1 if t.dtype == torch.int64 else 0


def launch(
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
    batch,
    total_tokens,
    heads,
    max_q_len,
    num_splits,
    stream,
    nonfinite_flag=None,
) -> None:
    lib = load()
    a = MtvArgs()
    a.q, a.q_s0, a.q_s1 = q.data_ptr(), q.stride(0), q.stride(1)
    a.k_draft, a.kd_s0 = k_draft.data_ptr(), k_draft.stride(0)
    a.kv_buffer, a.kv_s0, a.num_slots = kv_buffer.data_ptr(), kv_buffer.stride(0), kv_buffer.shape[0]
    a.qo_indptr, a.qo_is64 = qo_indptr.data_ptr(), _is64(qo_indptr)
    a.kv_indptr, a.kvp_is64 = kv_indptr.data_ptr(), _is64(kv_indptr)
    a.kv_indices, a.kvi_is64, a.kv_indices_len = kv_indices.data_ptr(), _is64(kv_indices), kv_indices.shape[0]
    if custom_mask is not None:
        a.custom_mask, a.mask_len = custom_mask.data_ptr(), custom_mask.shape[0]
        a.mask_indptr, a.mp_is64 = mask_indptr.data_ptr(), _is64(mask_indptr)
    a.o, a.o_s0, a.o_s1 = out.data_ptr(), out.stride(0), out.stride(1)
    if lse is not None:
        a.lse, a.lse_s0, a.lse_s1 = lse.data_ptr(), lse.stride(0), lse.stride(1)
    if workspace is not None:
        a.workspace = workspace.data_ptr()
        a.workspace_floats = workspace.numel() * workspace.element_size() // 4
    if error_flag is not None:
        a.error_flag = error_flag.data_ptr()
    if nonfinite_flag is not None:
        a.nonfinite_flag = nonfinite_flag.data_ptr()
    a.batch, a.total_tokens, a.heads = batch, total_tokens, heads
    a.max_q_len, a.num_splits, a.sm_scale = max_q_len, num_splits, sm_scale
    rc = lib.mtv_tree_verify(ctypes.byref(a), ctypes.c_void_p(stream))
    if rc != 0:
        raise RuntimeError(f"mla_tree_verify: launch failed ({rc}): {lib.mtv_error_string(rc).decode()}")
