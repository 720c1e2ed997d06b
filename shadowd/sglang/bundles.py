"""Repro bundles of the SGLang verify site: a call in a self-contained, compact form, and its replay.

A verify call reads a few rows of a cache that holds every request's KV (gigabytes), and SGLang objects that
do not serialise. Its bundle (``ShadowSite(bundle_args=bundle_args)``, see ``shadowd.hook.bundle`` and
``shadowd.hook.capture``) keeps only what the call reads, as the arguments of ``mla_tree_verify.tree_verify``:

* ``q`` [T, H, 576], the draft ``k`` [T, 1, 576];
* the prefix rows the call reads, gathered in ``kv_indices`` order: [n, 1, 576] with n = ``kv_indices.numel()``
  (an eager call's index list; indices clamped into the cache, so a bad one cannot fault the gather);
* ``qo_indptr``, ``kv_indptr``, ``kv_indices`` renumbered 0 … n − 1, ``custom_mask``, ``mask_indptr``;
* ``sm_scale`` and ``max_q_len`` as plain values.

:func:`replay_baseline` (SGLang's Triton extend-attention kernel, through ``mla_tree_verify.testing``),
:func:`replay_candidate` (the site's candidate function) and :func:`replay_oracle` (``mla_tree_verify.oracle``
in float32) take that form and return ``[T, H*512]`` like the site's outputs, so ``shadowd replay BUNDLE``
reruns all three.
"""

from __future__ import annotations

from typing import Any

import torch

from shadowd.sglang.candidate import D_QK, D_V, candidate_fn, oracle_fp32

__all__ = ["REFS", "bundle_args", "replay_baseline", "replay_candidate", "replay_oracle"]

REFS = {"baseline": "shadowd.sglang.bundles:replay_baseline",
        "candidate": "shadowd.sglang.bundles:replay_candidate",
        "oracle": "shadowd.sglang.bundles:replay_oracle"}


def _clone(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().clone()


def bundle_args(args: tuple[Any, ...], kwargs: dict[str, Any], max_bytes: int
                ) -> tuple[tuple[Any, ...], dict[str, Any], dict[str, str]] | None:
    """The compact form of one site call ``(call, q, k, v, kv_buffer, qo_indptr, kv_indptr, kv_indices,
    custom_mask, mask_indptr)`` as private copies, with :data:`REFS`; None when it exceeds ``max_bytes``."""
    call, q, k, _v, kv_buffer, qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr = args
    t = q.shape[0]
    cache = kv_buffer.reshape(kv_buffer.shape[0], -1)
    n = kv_indices.numel()
    small = [q, k, qo_indptr, kv_indptr, custom_mask, mask_indptr]
    need = n * cache.shape[1] * cache.element_size() + n * 8 + sum(
        x.numel() * x.element_size() for x in small if x is not None)
    if need > max_bytes:
        return None
    idx = kv_indices.reshape(-1).long().clamp(0, max(cache.shape[0] - 1, 0))
    rows = cache.index_select(0, idx).reshape(n, 1, D_QK)
    compact = (q.reshape(t, call.heads, D_QK).clone(), k.reshape(t, 1, D_QK).clone(), rows, qo_indptr.clone(),
               kv_indptr.clone(), torch.arange(n, dtype=torch.int64, device=q.device), _clone(custom_mask),
               _clone(mask_indptr) if custom_mask is not None else None)
    return compact, {"sm_scale": float(call.scaling), "max_q_len": int(call.max_q_len)}, dict(REFS)


def replay_baseline(q: torch.Tensor, k: torch.Tensor, kv_rows: torch.Tensor, qo_indptr: torch.Tensor,
                    kv_indptr: torch.Tensor, kv_indices: torch.Tensor, custom_mask: torch.Tensor | None,
                    mask_indptr: torch.Tensor | None, *, sm_scale: float, max_q_len: int) -> torch.Tensor:
    """SGLang's Triton extend-attention kernel on a bundle (needs sglang; CUDA, or Triton's interpreter)."""
    from mla_tree_verify.testing import Case, run_sglang_triton

    case = Case(q, k, kv_rows, qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr, sm_scale,
                prefix_lens=[], tree_sizes=[max_q_len], trees=None)
    out = torch.empty(q.shape[0], q.shape[1], D_V, dtype=q.dtype, device=q.device)
    return run_sglang_triton(case, out).reshape(q.shape[0], -1)


def replay_candidate(q: torch.Tensor, k: torch.Tensor, kv_rows: torch.Tensor, qo_indptr: torch.Tensor,
                     kv_indptr: torch.Tensor, kv_indices: torch.Tensor, custom_mask: torch.Tensor | None,
                     mask_indptr: torch.Tensor | None, *, sm_scale: float, max_q_len: int) -> torch.Tensor:
    """The site's candidate (``SHADOWD_CANDIDATE`` or ``mla_tree_verify.tree_verify``) on a bundle."""
    fn = candidate_fn(q.is_cuda)
    out = fn(q, k, kv_rows, qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr, sm_scale,
             max_q_len=max_q_len)
    return out.reshape(q.shape[0], -1)


def replay_oracle(q: torch.Tensor, k: torch.Tensor, kv_rows: torch.Tensor, qo_indptr: torch.Tensor,
                  kv_indptr: torch.Tensor, kv_indices: torch.Tensor, custom_mask: torch.Tensor | None,
                  mask_indptr: torch.Tensor | None, *, sm_scale: float, max_q_len: int) -> torch.Tensor:
    """``mla_tree_verify.oracle`` in float32 on a bundle."""
    del max_q_len
    return oracle_fp32(q, k, kv_rows, qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr,
                       sm_scale).reshape(q.shape[0], -1)
