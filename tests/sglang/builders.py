"""A target-verify step through the real ``TritonAttnBackend.forward_extend`` on the CPU (fp32).

Real sglang objects: ``MLATokenToKVPool``, ``RadixAttention`` layers, ``ForwardBatch``,
``ForwardMetadata``, the Triton ``extend_attention_fwd``. The backend object is made with
``TritonAttnBackend.__new__`` and given the attributes its ``__init__`` would derive from a model
runner (the verify path reads only those), and ``forward_metadata`` as ``init_forward_metadata``
fills it in target verify: qo_indptr = arange(0, (bs+1)·T, T), kv_indptr = cumsum(prefix), FULL_MASK.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["VerifyCase", "make_case", "run_layers", "tree_mask"]

D_QK, D_V = 576, 512


@dataclass
class VerifyCase:
    backend: Any
    pool: Any
    layers: list[Any]
    forward_batch: Any
    q: list[torch.Tensor]
    k: list[torch.Tensor]
    prefix: list[int]
    draft: int
    heads: int


def tree_mask(prefix: list[int], t: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang FULL_MASK of random trees (one per request) and its mask_indptr, on the CPU."""
    masks, indptr = [], [0]
    for lb in prefix:
        parent = [-1] + [int(torch.randint(0, j, (1,), generator=g)) for j in range(1, t)]
        m = torch.zeros(t, lb + t, dtype=torch.bool)
        m[:, :lb] = True
        for i in range(t):
            j = i
            while j >= 0:
                m[i, lb + j] = True
                j = parent[j]
        masks.append(m.flatten())
        indptr.append(indptr[-1] + m.numel())
    return torch.cat(masks), torch.tensor(indptr, dtype=torch.int64)


def make_case(tb: Any, *, layers: int = 3, heads: int = 2, prefix: tuple[int, ...] = (7, 13), draft: int = 4,
              slots: int = 64, seed: int = 0, mode: str = "TARGET_VERIFY", causal: bool = False,
              draft_runner: bool = False, cache_dtype: torch.dtype = torch.float32) -> VerifyCase:
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    g = torch.Generator().manual_seed(seed)
    bs = len(prefix)
    pool = MLATokenToKVPool(size=slots, page_size=1, dtype=cache_dtype, kv_lora_rank=D_V,
                            qk_rope_head_dim=D_QK - D_V, layer_num=layers, device="cpu", enable_memory_saver=False)
    for i in range(layers):
        pool.get_key_buffer(i)[1:] = (torch.randn(slots, 1, D_QK, generator=g) * 0.5).to(cache_dtype)
    used = torch.randperm(slots - bs * draft, generator=g)[: sum(prefix)] + 1  # scattered prefix slots
    free = sorted(set(range(1, slots + 1)) - set(used.tolist()))
    kv_indptr = torch.tensor([0, *torch.tensor(prefix).cumsum(0).tolist()], dtype=torch.int64)
    mask, mask_indptr = tree_mask(list(prefix), draft, g)
    md = tb.ForwardMetadata(
        attn_logits=None, attn_lse=None, max_extend_len=draft, num_kv_splits=None, kv_indptr=kv_indptr,
        kv_indices=used.to(torch.int64), qo_indptr=torch.arange(0, (bs + 1) * draft, draft, dtype=torch.int64),
        custom_mask=None if causal else mask, mask_indptr=mask_indptr, window_kv_indptr=None,
        window_kv_indices=None, window_num_kv_splits=None, window_kv_offsets=None)
    be = tb.TritonAttnBackend.__new__(tb.TritonAttnBackend)
    attrs = dict(use_dense_fp8_chunked_prefill=False, use_mla=True, token_to_kv_pool=pool, forward_metadata=md,
                 dcp_size=1, enable_deterministic=False, use_verify_shared_kv=False, use_verify_splitkv=False,
                 extend_attention_fwd=extend_attention_fwd, dllm_attention=None, page_size=1,
                 allow_bidirectional_attention_in_extend=False, is_draft_runner=draft_runner,
                 req_to_token_pool=None)
    for name, value in attrs.items():
        setattr(be, name, value)
    fb = ForwardBatch(forward_mode=getattr(ForwardMode, mode), batch_size=bs,
                      input_ids=torch.zeros(bs * draft, dtype=torch.int64), req_pool_indices=torch.arange(bs),
                      seq_lens=torch.tensor(prefix), out_cache_loc=torch.tensor(free[: bs * draft]),
                      seq_lens_sum=sum(prefix), seq_lens_cpu=torch.tensor(prefix))
    lyr = [RadixAttention(heads, D_QK, 192**-0.5, 1, i, v_head_dim=D_V) for i in range(layers)]
    q = [torch.randn(bs * draft, heads * D_QK, generator=g) * 0.5 for _ in range(layers)]
    k = [torch.randn(bs * draft, 1, D_QK, generator=g) * 0.5 for _ in range(layers)]
    return VerifyCase(be, pool, lyr, fb, q, k, list(prefix), draft, heads)


def run_layers(case: VerifyCase, forward_extend: Any = None) -> list[torch.Tensor]:
    """One verify step: forward_extend of every layer (what the model's attention layers call)."""
    from sglang.srt.runtime_context import get_parallel

    fe = forward_extend or type(case.backend).forward_extend
    outs = []
    with get_parallel().override(dcp_enabled=False):
        for layer, q, k in zip(case.layers, case.q, case.k, strict=True):
            outs.append(fe(case.backend, q, k, k[..., :D_V], layer, case.forward_batch).clone())
    return outs
