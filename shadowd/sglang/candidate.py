"""Baseline and candidate of the MLA tree-verify site, over one :class:`VerifyCall`.

Both take the same arguments, ``(call, q, k, v, kv_buffer, qo_indptr, kv_indptr, kv_indices,
custom_mask, mask_indptr)``, so that :class:`shadowd.hook.site.ShadowSite` can hand the candidate
clones of the small tensors and watch the large ones (the KV cache):

* :func:`baseline` — SGLang's own ``TritonAttnBackend.forward_extend`` (the un-hooked original)
  with ``save_kv_cache=False``: the draft K/V were already written by the hook, through SGLang's
  own ``_set_kv_buffer``, so it computes exactly what SGLang computes, into SGLang's output buffer.
* :func:`baseline_gate` — on mode under a CUDA graph, the context in which :func:`baseline` runs:
  SGLang's kernels read their work sizes from ``forward_metadata.qo_indptr`` / ``kv_indptr``, so
  those are swapped for device copies that hold zeros on replays that are neither spot checks nor
  fallbacks; the captured baseline then does almost nothing there and the graph runs at the
  candidate's speed (its output on those replays is never read: the select kernel serves the
  candidate).
* :func:`candidate_gate` — under a CUDA graph: the candidate's ``qo_indptr`` / ``kv_indptr`` replaced by device
  copies that hold zeros on replays that neither compare nor serve it (unsampled validate calls, the kill
  switch, a disabled or fallen-back candidate, the promotion gate's hold): every request is then empty and the
  kernel returns at once (no error bit: all-zero index pointers are consistent). In on mode its copies are
  made in the baseline gate's launch.
* :func:`candidate` — ``mla_tree_verify.tree_verify`` on CUDA (reads the cache, never writes it;
  its own output tensor). On CPU (tests) the fp32 oracle ``mla_tree_verify.oracle`` stands in.
  ``SHADOWD_CANDIDATE=module:function`` replaces it (same signature as ``tree_verify``). On CUDA it is
  passed :func:`error_flag`'s two words: ``error_flag``, the word its kernels raise bits in when they clamp an
  out-of-range index (the hook's statistics kernel reads it; :func:`describe_flag` names the bits), and
  ``nonfinite_flag``, the word they set when they write a NaN or an Inf (eager on mode compares the next step
  when it is set).
* :func:`oracle` — the site's reference for oracle sampling (``SHADOWD_ORACLE``, eager calls only):
  ``mla_tree_verify.oracle`` in float32 over the same inputs (it gathers only the rows a draft may see,
  the prefix in chunks of 4096 rows, so its memory stays bounded at 200k-token prefixes), ``[T, H*512]``
  fp32.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "CANDIDATE_ENV",
    "KV_BUFFER_ARG",
    "VerifyCall",
    "baseline",
    "baseline_fingerprint",
    "baseline_gate",
    "candidate",
    "candidate_fingerprint",
    "candidate_fn",
    "candidate_gate",
    "candidate_q_dtypes",
    "candidate_ref",
    "describe_flag",
    "error_flag",
    "oracle",
    "oracle_fp32",
]

CANDIDATE_ENV = "SHADOWD_CANDIDATE"
D_QK = 576
D_V = 512


@dataclass
class VerifyCall:
    """What both sides need besides the tensors: SGLang's objects and the static launch shape."""

    original: Callable[..., Any]
    backend: Any
    layer: Any
    forward_batch: Any
    heads: int
    scaling: float
    max_q_len: int


def baseline(call: VerifyCall, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *_: Any) -> torch.Tensor:
    """SGLang's Triton path (cache already written): ``[T, H*512]`` in SGLang's output buffer."""
    out: torch.Tensor = call.original(call.backend, q, k, v, call.layer, call.forward_batch, save_kv_cache=False)
    return out


@contextmanager
def baseline_gate(sstate: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[None]:
    """Gate the baseline's work through the call's decision words ``sstate`` (see the module docstring;
    graph capture only)."""
    from shadowd.hook.device import RUN_BASE, gated_copies

    md = args[0].backend.forward_metadata
    qo, kv = md.qo_indptr, md.kv_indptr
    md.qo_indptr, md.kv_indptr = gated_copies([qo, kv], sstate, RUN_BASE)
    try:
        yield
    finally:
        md.qo_indptr, md.kv_indptr = qo, kv


#: positions of the latent cache, qo_indptr and kv_indptr in the site's argument tuple (see the module docstring)
KV_BUFFER_ARG, _QO, _KV = 4, 5, 6


def candidate_gate(sstate: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]
                   ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The candidate's arguments with its work sizes gated (see the module docstring; graph capture only)."""
    from shadowd.hook.device import RUN_CAND, gated_copies

    gated = list(args)
    gated[_QO], gated[_KV] = gated_copies([args[_QO], args[_KV]], sstate, RUN_CAND)
    return tuple(gated), kwargs


def oracle_fp32(q: torch.Tensor, k: torch.Tensor, kv_buffer: torch.Tensor, qo_indptr: torch.Tensor,
                kv_indptr: torch.Tensor, kv_indices: torch.Tensor, custom_mask: torch.Tensor | None,
                mask_indptr: torch.Tensor | None, sm_scale: float, **_: Any) -> torch.Tensor:
    """``mla_tree_verify.oracle`` in float32 with ``tree_verify``'s arguments: ``[T, H, 512]`` float32."""
    from mla_tree_verify import oracle as mtv_oracle

    out: torch.Tensor = mtv_oracle.attention(q, k, kv_buffer, qo_indptr, kv_indptr, kv_indices, custom_mask,
                                             mask_indptr, sm_scale, dtype=torch.float32)
    return out


def _oracle_fp32(*args: Any, **kwargs: Any) -> torch.Tensor:
    # the CPU stand-in candidate: the oracle, in q's dtype
    return oracle_fp32(*args, **kwargs).to(args[0].dtype)


_RESOLVED: dict[str, Callable[..., torch.Tensor]] = {}


#: the q dtypes a candidate takes, by its reference (``SHADOWD_CANDIDATE``'s form); one not listed takes what
#: SGLang's path takes, and its refusals become samples
_Q_DTYPES: dict[str, tuple[torch.dtype, ...]] = {"mla_tree_verify:tree_verify": (torch.bfloat16,)}


def candidate_ref(cuda: bool, env: Mapping[str, str] | None = None) -> str:
    """The ``module:function`` reference of the candidate (``""``: the CPU stand-in, the fp32 oracle)."""
    return (os.environ if env is None else env).get(CANDIDATE_ENV) or ("mla_tree_verify:tree_verify" if cuda else "")


def candidate_q_dtypes(cuda: bool, env: Mapping[str, str] | None = None) -> tuple[torch.dtype, ...] | None:
    """The q dtypes the candidate takes, where known (``tree_verify``: bf16 only); None: not known."""
    return _Q_DTYPES.get(candidate_ref(cuda, env))


def candidate_fn(cuda: bool, env: Mapping[str, str] | None = None) -> Callable[..., torch.Tensor]:
    """The function with ``tree_verify``'s signature that serves as candidate."""
    ref = candidate_ref(cuda, env)
    if not ref:
        return _oracle_fp32
    fn = _RESOLVED.get(ref)
    if fn is None:
        mod, _, name = ref.partition(":")
        fn = getattr(importlib.import_module(mod), name or "tree_verify")
        _RESOLVED[ref] = fn
    return fn


def candidate(call: VerifyCall, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_buffer: torch.Tensor,
              qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
              custom_mask: torch.Tensor | None, mask_indptr: torch.Tensor | None) -> torch.Tensor:
    """The project's kernel over the same inputs: ``[T, H*512]`` like SGLang's output (own buffer)."""
    del v  # MLA: v is the first 512 columns of k (and of the cache rows)
    t = q.shape[0]
    fn = candidate_fn(q.is_cuda)
    extra = _words_for(fn, q.get_device()) if q.is_cuda else {}
    out = fn(q.view(t, call.heads, D_QK), k.view(t, -1, D_QK), kv_buffer, qo_indptr, kv_indptr, kv_indices,
             custom_mask, mask_indptr if custom_mask is not None else None, call.scaling, max_q_len=call.max_q_len,
             **extra)
    return out.view(t, call.heads * D_V)


@functools.cache
def _takes(fn: Callable[..., Any], name: str) -> bool:
    # a SHADOWD_CANDIDATE written before a word existed keeps working without it
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


_WORD_NAMES = ("error_flag", "nonfinite_flag")
#: by CUDA device index: the int32 [2] words, and views of its two elements (made once: a view per call costs)
_FLAGS: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
#: by (candidate function, CUDA device index): the keyword arguments of the words it takes (:func:`_words_for`)
_EXTRA: dict[tuple[Callable[..., Any], int], dict[str, torch.Tensor]] = {}


def error_flag(device: torch.device) -> torch.Tensor | None:
    """The candidate's device words on ``device``, int32 [2], one pair per device shared by every call
    (``ShadowSite(candidate_flag=...)``): element 0 is ``tree_verify``'s ``error_flag`` (bits OR-ed in when a launch
    clamps an out-of-range index, never cleared by it; read by the hook's statistics kernel), element 1 its
    ``nonfinite_flag`` (set when a launch writes a NaN or an Inf; eager on mode reads it once per step and clears
    it). Made on first use outside graph capture (memory allocated while capturing would belong to that graph);
    None before that, and on CPU."""
    if device.type != "cuda":
        return None
    words = _flag_of(device.index if device.index is not None else torch.cuda.current_device())
    return words[0] if words is not None else None


def _words_for(fn: Callable[..., Any], index: int) -> dict[str, torch.Tensor]:
    """The words ``fn`` takes, by keyword, on device ``index`` (one dict per function and device, made once: an eager
    call pays a dict lookup; ``{}`` under capture before the words exist, not kept)."""
    extra = _EXTRA.get((fn, index))
    if extra is None:
        words = _flag_of(index)
        if words is None:
            return {}
        extra = _EXTRA[(fn, index)] = {name: word for name, word in zip(_WORD_NAMES, words[1:], strict=True)
                                       if _takes(fn, name)}
    return extra


def _flag_of(index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    # per call: a dict lookup by device index (``q.device`` would build a device object every call)
    words = _FLAGS.get(index)
    if words is None and not torch.cuda.is_current_stream_capturing():
        both = torch.zeros(2, dtype=torch.int32, device=torch.device("cuda", index))
        words = _FLAGS[index] = (both, both[:1], both[1:])
    return words


def describe_flag(value: int) -> str:
    """The bits of :func:`error_flag` in words (``mla_tree_verify.ERROR_BITS``)."""
    try:
        from mla_tree_verify import decode_error_flag

        return ", ".join(decode_error_flag(value)) or f"0x{value:x}"
    except ImportError:
        return f"0x{value:x}"


def oracle(call: VerifyCall, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_buffer: torch.Tensor,
           qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
           custom_mask: torch.Tensor | None, mask_indptr: torch.Tensor | None) -> torch.Tensor:
    """The fp32 reference over the same inputs: ``[T, H*512]`` float32 (see the module docstring)."""
    del v
    t = q.shape[0]
    out = oracle_fp32(q.view(t, call.heads, D_QK), k.view(t, -1, D_QK), kv_buffer, qo_indptr, kv_indptr, kv_indices,
                      custom_mask, mask_indptr if custom_mask is not None else None, call.scaling)
    return out.reshape(t, call.heads * D_V)


def candidate_fingerprint(env: Mapping[str, str] | None = None) -> str:
    """What identifies the candidate build that will be served: the hash of the prebuilt library's bytes when
    ``MLA_TREE_VERIFY_LIB`` names one (that file is what the kernel loads, whatever the sources say), else the
    ``mla_tree_verify`` source hash (what its build cache is keyed by); ``unknown`` when neither can be read."""
    import hashlib

    lib = (os.environ if env is None else env).get("MLA_TREE_VERIFY_LIB")
    try:
        if lib:
            return f"mla_tree_verify-lib-{hashlib.sha256(Path(lib).read_bytes()).hexdigest()[:16]}"
        from mla_tree_verify import _build

        return f"mla_tree_verify-src-{_build.source_hash()[:16]}"
    except Exception:
        return "unknown"


def baseline_fingerprint(sglang_version: str) -> str:
    """SGLang version, Triton version and the hash of SGLang's extend-attention kernel source."""
    import hashlib

    digest = "unknown"
    try:
        spec = importlib.util.find_spec("sglang.kernels.ops.attention.extend_attention")
        if spec is not None and spec.origin:
            with open(spec.origin, "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()[:16]
    except Exception:
        pass
    try:
        import triton

        tv = triton.__version__
    except Exception:
        tv = "none"
    return f"sglang-{sglang_version}-triton-{tv}-extend_attention-{digest}"
