"""The AROUND hook on ``TritonAttnBackend.forward_extend``: shadow MLA tree verify of the target model.

A call is shadowed only when all of these hold (anything else goes to SGLang untouched, with the
caller's exact arguments):

* ``forward_batch.forward_mode.is_target_verify()`` and not ``backend.is_draft_runner`` (the
  DFLASH/DSPARK draft runners also run in verify mode);
* absorbed MLA shapes (``qk_head_dim`` 576, ``v_head_dim`` 512, one latent KV head), no KV
  scales (FP8 KV), no sinks / score_mod / aux tensors / logit cap / sliding window / DCP / DLLM,
  decoder self-attention (causal), K/V given (not read back), q in bf16/fp16/fp32 — and in a dtype the candidate
  takes, where that is known (``tree_verify``, the default candidate on CUDA: bf16) — and the draft k and the
  layer's KV cache in q's dtype (an fp8 cache without KV scales — ``--kv-cache-dtype fp8_e4m3`` — is SGLang's: its
  kernel rounds q to fp8 for the dot, and the candidate takes a cache in q's dtype only);
* the effective mode (kill switch applied) is not ``off``.

For a shadowed call the hook first writes the draft K/V into the cache exactly as SGLang does
(``KVWriteLoc.for_batch`` + ``backend._set_kv_buffer``, the same calls ``forward_extend`` makes),
then hands baseline (SGLang's Triton path, ``save_kv_cache=False``) and candidate to the
:class:`shadowd.hook.site.ShadowSite`. So in *validate* the candidate only ever reads a cache SGLang
has written, and returns nothing to SGLang; in *on* the cache write, and the output layout
(``[T, H*512]``, into ``forward_batch._attn_output`` when SGLang set one) are SGLang's.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from shadowd.hook.runtime import HookRuntime, get_runtime
from shadowd.hook.site import Bucket, ShadowSite
from shadowd.sglang.bundles import bundle_args
from shadowd.sglang.candidate import (
    D_QK,
    D_V,
    KV_BUFFER_ARG,
    VerifyCall,
    baseline,
    baseline_gate,
    candidate,
    candidate_gate,
    candidate_q_dtypes,
    describe_flag,
    error_flag,
    oracle,
)
from shadowd.sglang.padding import graph_shape, warm_graph_shape

__all__ = ["SITE_NAME", "TARGET", "VerifyShadow", "ineligible"]

log = logging.getLogger("shadowd.sglang")

TARGET = "sglang.srt.layers.attention.triton_backend.TritonAttnBackend.forward_extend"
SITE_NAME = "sglang.mla_tree_verify"
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: the pass-through reasons of every deployment (prefill, decode, the draft runner, mode off): never logged
_COMMON = frozenset(("not target verify", "draft runner", "mode off"))


def ineligible(backend: Any, q: Any, k: Any, v: Any, layer: Any, forward_batch: Any, sinks: Any = None,
               score_mod: Any = None, aux_tensors: Any = None) -> str | None:
    """Why this ``forward_extend`` call is not shadowed (None: it is)."""
    return (_step_reason(backend, forward_batch) or _layer_reason(backend, layer)
            or _call_reason(q, k, v, forward_batch, sinks, score_mod, aux_tensors, candidate_q_dtypes(q.is_cuda))
            or _cache_reason(q, k, backend.token_to_kv_pool.get_key_buffer(layer.layer_id)))


def _cache_reason(q: torch.Tensor, k: torch.Tensor, kv_buffer: torch.Tensor) -> str | None:
    """What excludes this call for the layer's KV cache: one in another dtype than q (fp8 KV cache), or a draft k
    in another dtype than q."""
    if kv_buffer.dtype != q.dtype or k.dtype != q.dtype:
        return "KV cache dtype differs from q"
    return None


def _step_reason(backend: Any, forward_batch: Any) -> str | None:
    """What excludes every layer's call of this forward (the common pass-through: prefill, decode, drafts)."""
    if getattr(backend, "is_draft_runner", False):
        return "draft runner"
    mode = getattr(forward_batch, "forward_mode", None)
    if mode is None or not mode.is_target_verify():
        return "not target verify"
    return None


def _call_reason(q: Any, k: Any, v: Any, forward_batch: Any, sinks: Any, score_mod: Any,
                 aux_tensors: Any, q_dtypes: tuple[torch.dtype, ...] | None = None) -> str | None:
    """What excludes this one call (its arguments); ``q_dtypes``: the q dtypes the candidate takes, when known."""
    if k is None or v is None or sinks is not None or score_mod is not None or aux_tensors is not None:
        return "k/v missing or sinks/score_mod/aux_tensors"
    if getattr(forward_batch, "mha_one_shot", False):
        return "MHA one-shot"
    if q.dtype not in _DTYPES or q.shape[0] != k.shape[0] or k.shape[-1] != D_QK:
        return "dtype/shape"
    if q_dtypes is not None and q.dtype not in q_dtypes:
        return f"q dtype {q.dtype} is not one the candidate takes ({', '.join(map(str, q_dtypes))})"
    return None


def _layer_reason(backend: Any, layer: Any) -> str | None:
    """What excludes a layer on this backend whatever the call: fixed once the model is loaded (cached by
    :class:`VerifyShadow` per backend and layer)."""
    if not getattr(backend, "use_mla", False):
        return "not MLA"
    if getattr(layer, "qk_head_dim", None) != D_QK or getattr(layer, "v_head_dim", None) != D_V:
        return "not absorbed MLA (576/512)"
    if getattr(layer, "k_scale", None) is not None or getattr(layer, "v_scale", None) is not None:
        return "KV scales"
    if (getattr(layer, "logit_cap", 0) or 0) > 0 or (getattr(layer, "xai_temperature_len", -1) or -1) > 0:
        return "logit cap / temperature"
    sw = getattr(layer, "sliding_window_size", None)
    if sw is not None and sw > -1:
        return "sliding window"
    if getattr(layer, "is_cross_attention", False) or getattr(getattr(layer, "attn_type", None), "name",
                                                              "DECODER") != "DECODER":
        return "not causal decoder self-attention"
    if getattr(backend, "dcp_size", 1) != 1 or getattr(backend, "dllm_attention", None) is not None:
        return "DCP / DLLM"
    return None


class VerifyShadow:
    """The hook (``HookRegistry`` AROUND callable): ``(original, backend, q, k, v, layer, forward_batch, ...)``."""

    def __init__(self, runtime: HookRuntime | None = None, first_layer: int | None = None) -> None:
        self._runtime = runtime
        self._first_layer = first_layer
        self.site: ShadowSite | None = None
        self.passed = 0
        self.shadowed = 0
        self.hook_faults = 0  # the wrapper's own failures (:meth:`_hook_fault`): after one, SGLang serves every call
        self.reasons: dict[str, int] = {}
        # per (backend, layer) id: the objects (so a reused id is never mistaken for them) and _layer_reason's answer
        self._layer_reasons: dict[tuple[int, int], tuple[Any, Any, str | None]] = {}
        #: by q.is_cuda: the q dtypes the candidate takes (None: not known), read once (the candidate is fixed at start)
        self._q_dtypes: dict[bool, tuple[torch.dtype, ...] | None] = {}

    def _site(self, backend: Any) -> ShadowSite:
        if self.site is None:
            first = self._first_layer
            if first is None:
                first = int(getattr(getattr(backend, "token_to_kv_pool", None), "start_layer", 0) or 0)
            self.site = ShadowSite(SITE_NAME, baseline, candidate, oracle=oracle,
                                   runtime=self._runtime or get_runtime(), first_layer=first,
                                   baseline_gate=baseline_gate, candidate_gate=candidate_gate, bundle_args=bundle_args,
                                   candidate_flag=error_flag, describe_flag=describe_flag,
                                   # the latent cache: shared with the candidate and watched, never cloned,
                                   # whatever its size (a small pool's clone per call slowed SGLang's kernel 4 %)
                                   shared=(KV_BUFFER_ARG,),
                                   refs={"baseline": "shadowd.sglang.candidate:baseline",
                                         "candidate": "shadowd.sglang.candidate:candidate",
                                         "oracle": "shadowd.sglang.candidate:oracle"})
        return self.site

    def __call__(self, original: Any, backend: Any, q: Any, k: Any, v: Any, layer: Any, forward_batch: Any,
                 save_kv_cache: bool = True, sinks: Any = None, score_mod: Any = None, aux_tensors: Any = None,
                 **extra: Any) -> Any:
        rt = self._runtime or get_runtime()
        why = "extra arguments" if extra else None
        if why is None and rt.mode_code == 0:
            why = "mode off"
        if why is None:
            why = (_step_reason(backend, forward_batch)
                   or ("the hook failed (logged above): the candidate is disabled" if self.hook_faults else None)
                   or self._layer_reason(backend, layer)
                   or _call_reason(q, k, v, forward_batch, sinks, score_mod, aux_tensors, self._candidate_dtypes(q)))
        kv_buffer = None
        if why is None:
            kv_buffer = backend.token_to_kv_pool.get_key_buffer(layer.layer_id)
            why = _cache_reason(q, k, kv_buffer)
        if why is not None:
            self.passed += 1
            seen = self.reasons.get(why, 0)
            self.reasons[why] = seen + 1
            if not seen and why not in _COMMON:  # a target-verify call of the target model: say why, once per reason
                log.warning("shadowd: target-verify calls not shadowed (served by SGLang, untouched): %s (first seen "
                            "at layer %s; counted, said once)", why, getattr(layer, "layer_id", "?"))
            return original(backend, q, k, v, layer, forward_batch, save_kv_cache, sinks, score_mod, aux_tensors,
                            **extra)
        self.shadowed += 1
        md = backend.forward_metadata
        written = False  # whether this wrapper wrote the draft K/V (then SGLang's fallback must not write it again)
        try:
            if save_kv_cache:
                self._write_kv(backend, layer, forward_batch, k, v)
                written = True
            site = self._site(backend)
            heads = int(layer.tp_q_head_num)
            call = VerifyCall(original, backend, layer, forward_batch, heads, float(layer.scaling),
                              int(md.max_extend_len))
            layer_id = int(layer.layer_id)
            bucket = self._bucket(q, heads, forward_batch, md, site, layer_id)
        except Exception as e:  # the hook's own code before the site (its glue to SGLang's KV write included):
            # SGLang serves the call, writing the draft K/V itself unless the wrapper already did
            self._hook_fault(rt, e)
            return original(backend, q, k, v, layer, forward_batch, save_kv_cache and not written, sinks, score_mod,
                            aux_tensors)
        out = site(call, q, k, v, kv_buffer, md.qo_indptr, md.kv_indptr, md.kv_indices, md.custom_mask,
                   md.mask_indptr, layer=layer_id, bucket=bucket)
        attn_out = getattr(forward_batch, "_attn_output", None)
        if attn_out is not None and out is not attn_out and out.data_ptr() != attn_out.data_ptr():
            attn_out.copy_(out.view(attn_out.shape))  # SGLang's layout: its own buffer
            return attn_out
        return out

    def _hook_fault(self, rt: Any, err: Exception) -> None:
        """What the wrapper's own code raised before the site took the call (writing the draft K/V, building the
        site or the call's shape bucket): the candidate is disabled for the process with the reason (reported with
        the producer's figures) and the traceback logged once; the caller serves SGLang's own forward."""
        self.hook_faults += 1
        if self.hook_faults == 1:
            log.error("shadowd: the verify hook failed before its site; SGLang serves the call", exc_info=err)
        rt.disable(f"hook error: {type(err).__name__}: {err}")

    def _candidate_dtypes(self, q: Any) -> tuple[torch.dtype, ...] | None:
        # the q dtypes the candidate takes (None: not known), read once per device kind: the candidate is fixed
        cuda = bool(getattr(q, "is_cuda", False))
        if cuda not in self._q_dtypes:
            self._q_dtypes[cuda] = candidate_q_dtypes(cuda)
        return self._q_dtypes[cuda]

    def _layer_reason(self, backend: Any, layer: Any) -> str | None:
        # the attributes read are fixed once the model is loaded: computed on a layer's first verify call only
        key = (id(backend), id(layer))
        hit = self._layer_reasons.get(key)
        if hit is None or hit[0] is not backend or hit[1] is not layer:
            hit = (backend, layer, _layer_reason(backend, layer))
            self._layer_reasons[key] = hit
        return hit[2]

    @staticmethod
    def _write_kv(backend: Any, layer: Any, forward_batch: Any, k: torch.Tensor, v: torch.Tensor) -> None:
        """The draft K/V into the cache at ``out_cache_loc``: the very calls ``forward_extend`` makes."""
        from sglang.srt.mem_cache.memory_pool import KVWriteLoc

        loc = KVWriteLoc.for_batch(forward_batch, swa_loc=backend.forward_metadata.swa_out_cache_loc)
        backend._set_kv_buffer(forward_batch, layer, loc, k, v)

    @staticmethod
    def _bucket(q: torch.Tensor, heads: int, forward_batch: Any, md: Any, site: ShadowSite,
                layer_id: int) -> Bucket:
        capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
        return _make_bucket(q.shape[0], heads, forward_batch, md, site, layer_id, capturing)


def _original_size(forward_batch: Any, bs: int, rows: int) -> tuple[int, int]:
    """(requests, token rows) of an eager batch before SGLang padded it for data-parallel attention (its
    ``_original_batch_size`` / ``_original_num_tokens``, set by ``prepare_mlp_sync_batch``); else (bs, rows)."""
    ob = getattr(forward_batch, "_original_batch_size", None)
    on = getattr(forward_batch, "_original_num_tokens", None)
    real_bs = ob if isinstance(ob, int) and 0 <= ob < bs else bs
    real_rows = on if isinstance(on, int) and 0 <= on < rows else rows
    return real_bs, real_rows


def _make_bucket(rows: int, heads: int, forward_batch: Any, md: Any, site: ShadowSite, layer_id: int,
                 capturing: bool) -> Bucket:
    """The call's shape bucket. Eagerly from host values; inside a graph capture from device memory
    (:func:`shadowd.sglang.padding.graph_shape`: the real requests and token rows of each replay, padding
    excluded), one tensor per forward, rebuilt by the first layer inside the capture (so it is part of the graph)."""
    if not capturing:  # eagerly every layer of a step has the same bucket: made by its first call
        hit = getattr(forward_batch, "_shadowd_bucket", None)
        if hit is not None and hit[0] is md and hit[1] == rows and hit[2] == heads:
            return hit[3]
    bs = max(1, int(getattr(forward_batch, "batch_size", 0) or md.qo_indptr.shape[0] - 1))
    draft = max(1, int(md.max_extend_len) if md.max_extend_len else rows // bs)
    if capturing:
        meta = getattr(forward_batch, "_shadowd_meta", None)
        if meta is None or layer_id == site.first_layer:
            meta = graph_shape(md.qo_indptr, md.kv_indptr, getattr(forward_batch, "out_cache_loc", None), bs,
                               draft, rows)
            forward_batch._shadowd_meta = meta
        return Bucket(batch_size=bs, draft_tokens=draft, prefix_len=0, heads=heads, valid_rows=meta[3],
                      meta=meta[:3])
    # the shape tensor's kernel is compiled here, eagerly (SGLang's warm-up), not inside the capture that uses it
    warm_graph_shape(md.qo_indptr, md.kv_indptr, getattr(forward_batch, "out_cache_loc", None))
    # an eager batch padded for data-parallel attention (ForwardBatch.prepare_mlp_sync_batch) keeps its real size
    real_bs, real_rows = _original_size(forward_batch, bs, rows)
    prefix = 0
    seq_cpu = getattr(forward_batch, "seq_lens_cpu", None)
    if seq_cpu is not None and len(seq_cpu) and real_bs:
        prefix = int(max(seq_cpu[:real_bs].tolist()))
    bucket = Bucket(batch_size=max(real_bs, 1), draft_tokens=draft, prefix_len=prefix, heads=heads,
                    valid_rows=real_rows)
    forward_batch._shadowd_bucket = (md, rows, heads, bucket)
    return bucket
