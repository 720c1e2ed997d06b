"""Helpers for tests and benchmarks: trees, SGLang-format metadata, random cases, pass rules.

Metadata follows SGLang 0.5.23 target verify (read from its source): qo_indptr int32,
kv_indptr int32, kv_indices int64, mask_indptr int64, custom_mask bool (eager; uint8 in the
CUDA-graph buffer) as FULL_MASK: per request T rows x (L+T) columns, row-major, prefix columns True.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

D_QK = 576
D_V = 512
MLA_SM_SCALE = 192**-0.5


# ----------------------------------------------------------------------------- trees
def random_tree(T: int, kind: str = "random", gen: torch.Generator | None = None) -> list[int]:
    """Parent array of a T-node tree (parent[0] = -1, parent[i] < i).

    kind: "random" (each node picks a random earlier parent), "chain" (a path), "star" (all
    children of the root), "wide" (a few chains hanging off the root)."""
    if T <= 0:
        return []
    if kind == "chain":
        return [-1, *list(range(T - 1))]
    if kind == "star":
        return [-1] + [0] * (T - 1)
    parents = [-1]
    for i in range(1, T):
        if kind == "wide":
            parents.append(0 if i <= 4 else i - 4)
        else:
            parents.append(int(torch.randint(0, i, (1,), generator=gen)))
    return parents


def ancestor_matrix(parents: list[int]) -> torch.Tensor:
    """[T, T] bool: entry (i, j) True iff j is i or an ancestor of i."""
    T = len(parents)
    vis = torch.zeros(T, T, dtype=torch.bool)
    for i in range(T):
        j = i
        while j >= 0:
            vis[i, j] = True
            j = parents[j]
    return vis


def build_metadata(
    prefix_lens: list[int],
    trees: list[list[int]] | None,
    tree_sizes: list[int] | None = None,
    num_slots: int | None = None,
    gen: torch.Generator | None = None,
    device="cpu",
    scattered: bool = True,
    mask_dtype=torch.bool,
) -> dict:
    """SGLang target-verify metadata.  ``trees`` None -> custom_mask None (causal among drafts).

    Prefix slots are distinct random slots in [1, num_slots) (slot 0 is SGLang's padding dummy),
    or consecutive ones when ``scattered`` is False."""
    B = len(prefix_lens)
    sizes = [len(t) for t in trees] if trees is not None else list(tree_sizes or [])
    assert len(sizes) == B
    total_prefix = sum(prefix_lens)
    if num_slots is None:
        num_slots = total_prefix + 1
    assert num_slots >= total_prefix + 1, "need a distinct slot per prefix row plus the dummy"
    if scattered:
        slots = torch.randperm(num_slots - 1, generator=gen)[:total_prefix] + 1
    else:
        slots = torch.arange(1, total_prefix + 1)
    qo = torch.tensor([0, *list(itertools_accumulate(sizes))], dtype=torch.int32)
    kvp = torch.tensor([0, *list(itertools_accumulate(prefix_lens))], dtype=torch.int32)
    meta = {
        "qo_indptr": qo.to(device),
        "kv_indptr": kvp.to(device),
        "kv_indices": slots.to(torch.int64).to(device),
        "custom_mask": None,
        "mask_indptr": None,
        "num_slots": num_slots,
    }
    if trees is not None:
        chunks, starts, pos = [], [], 0
        for L, par in zip(prefix_lens, trees, strict=False):
            T = len(par)
            m = torch.ones(T, L + T, dtype=torch.bool)
            m[:, L:] = ancestor_matrix(par)
            chunks.append(m.flatten())
            starts.append(pos)
            pos += T * (L + T)
        starts.append(pos)
        meta["custom_mask"] = (
            torch.cat(chunks).to(mask_dtype).to(device)
            if chunks
            else torch.zeros(0, dtype=mask_dtype, device=device)
        )
        meta["mask_indptr"] = torch.tensor(starts, dtype=torch.int64, device=device)
    return meta


def itertools_accumulate(xs):
    s = 0
    for x in xs:
        s += x
        yield s


# ----------------------------------------------------------------------------- cases
@dataclass
class Case:
    q: torch.Tensor
    k_draft: torch.Tensor
    kv_buffer: torch.Tensor
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    custom_mask: torch.Tensor | None
    mask_indptr: torch.Tensor | None
    sm_scale: float
    prefix_lens: list[int]
    tree_sizes: list[int]
    trees: list[list[int]] | None
    desc: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def heads(self) -> int:
        return self.q.shape[1]

    @property
    def max_q_len(self) -> int:
        return max(self.tree_sizes) if self.tree_sizes else 0

    def args(self):
        return (
            self.q,
            self.k_draft,
            self.kv_buffer,
            self.qo_indptr,
            self.kv_indptr,
            self.kv_indices,
            self.custom_mask,
            self.mask_indptr,
            self.sm_scale,
        )

    def to(self, device) -> Case:
        mv = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        return Case(**mv)


def make_case(
    prefix_lens: list[int],
    tree_sizes: list[int],
    heads: int,
    *,
    seed: int = 0,
    tree_kind: str = "random",
    use_mask: bool = True,
    logit_std: float = 1.0,
    device="cpu",
    extra_slots: int = 64,
    scattered: bool = True,
    mask_dtype=torch.bool,
    sm_scale: float = MLA_SM_SCALE,
) -> Case:
    """Random case.  ``logit_std`` is the std of the scaled logits sm_scale*q.k (1: unit; 5-10: peaky).

    kv entries ~ N(0, 1); q entries scaled so that sm_scale * q.k has std ``logit_std``."""
    gen = torch.Generator().manual_seed(seed)
    trees = [random_tree(T, tree_kind, gen) for T in tree_sizes] if use_mask else None
    num_slots = sum(prefix_lens) + 1 + extra_slots
    meta = build_metadata(
        prefix_lens,
        trees,
        tree_sizes,
        num_slots=num_slots,
        gen=gen,
        scattered=scattered,
        mask_dtype=mask_dtype,
    )
    total = sum(tree_sizes)
    q_std = logit_std / (sm_scale * math.sqrt(D_QK))
    dev = torch.device(device)
    dgen = gen if dev.type == "cpu" else torch.Generator(device=dev).manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=dgen, device=dev)

    q = (rnd(total, heads, D_QK) * q_std).to(torch.bfloat16)
    kd = rnd(total, 1, D_QK).to(torch.bfloat16)
    kv = rnd(num_slots, 1, D_QK).to(torch.bfloat16)
    desc = (
        f"B={len(prefix_lens)} L={prefix_lens[:4]}{'...' if len(prefix_lens) > 4 else ''} "
        f"T={tree_sizes[:4]}{'...' if len(tree_sizes) > 4 else ''} H={heads} "
        f"tree={tree_kind if use_mask else 'causal'}"
        f" logit_std={logit_std}"
    )
    c = Case(
        q,
        kd,
        kv,
        meta["qo_indptr"],
        meta["kv_indptr"],
        meta["kv_indices"],
        meta["custom_mask"],
        meta["mask_indptr"],
        sm_scale,
        list(prefix_lens),
        list(tree_sizes),
        trees,
        desc,
    )
    return c.to(dev) if dev.type != "cpu" else c


def random_case_specs(seed: int, n: int, max_prefix: int = 3000, max_heads: int = 128) -> list[dict]:
    """``n`` varied make_case keyword sets: prefix 0/1/random, T 1..257 (non-powers of two), H 1..128,
    random/chain/star trees or causal, unit or peaky logits."""
    g = torch.Generator().manual_seed(seed)

    def ri(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    specs = []
    t_choices = [1, 2, 3, 7, 8, 13, 16, 31, 64, 100, 129, 257]
    h_choices = [1, 2, 5, 8, 16, 64, 128]
    for i in range(n):
        B = ri(1, 4)
        H = h_choices[ri(0, len(h_choices) - 1)] if max_heads >= 128 else min(max_heads, h_choices[ri(0, 4)])
        tmax = 257 if H <= 16 else 64
        T_opts = [t for t in t_choices if t <= tmax]
        same_T = ri(0, 1) == 1
        Tfix = T_opts[ri(0, len(T_opts) - 1)]
        sizes = [Tfix if same_T else T_opts[ri(0, len(T_opts) - 1)] for _ in range(B)]
        prefix = []
        for _ in range(B):
            kind = ri(0, 4)
            prefix.append(0 if kind == 0 else 1 if kind == 1 else ri(2, max_prefix))
        specs.append(
            dict(
                prefix_lens=prefix,
                tree_sizes=sizes,
                heads=H,
                seed=seed * 1000 + i,
                tree_kind=["random", "chain", "star", "wide"][ri(0, 3)],
                use_mask=ri(0, 4) != 0,
                logit_std=[1.0, 1.0, 5.0, 10.0][ri(0, 3)],
            )
        )
    return specs


# ----------------------------------------------------------------------------- metrics
def ulp_bf16(x: float) -> float:
    """Spacing of bf16 numbers at magnitude ``x`` (8 significant bits)."""
    if x <= 0 or not math.isfinite(x):
        return 2.0**-133
    return 2.0 ** (math.floor(math.log2(x)) - 7)


def error_stats(x: torch.Tensor, ref: torch.Tensor) -> dict:
    """max-abs, rel-L2 and cosine difference sum((x-y)^2)/sum(x^2+y^2) over finite reference entries."""
    x = x.double()
    ref = ref.double()
    fin = torch.isfinite(ref)
    d = (x - ref)[fin]
    r = ref[fin]
    xf = x[fin]
    max_abs = d.abs().max().item() if d.numel() else 0.0
    den = r.norm().item()
    rel = d.norm().item() / den if den > 0 else d.norm().item()
    cden = (xf.pow(2) + r.pow(2)).sum().item()
    cos = d.pow(2).sum().item() / cden if cden > 0 else 0.0
    return {
        "max_abs": max_abs,
        "rel_l2": rel,
        "cos_diff": cos,
        "ref_max": r.abs().max().item() if r.numel() else 0.0,
    }


def pass_rule(
    cand: torch.Tensor,
    oracle: torch.Tensor,
    triton: torch.Tensor | None = None,
    bf16_tol: tuple[float, float] = (2e-2, 1.5e-2),
) -> tuple[bool, dict]:
    """The project's per-case rule (candidate vs oracle; Triton the baseline when given):

    * non-finite positions of cand equal the oracle's;
    * max|c-o| <= 2 max|t-o| + ulp_bf16(max|o|) and relL2(c,o) <= 2 relL2(t,o) + 2^-12 (with Triton);
      without Triton: max|c-o| <= bf16_tol[0] * max|o| + ulp and relL2 <= bf16_tol[1];
    * cosine difference sum((c-o)^2)/sum(c^2+o^2) <= 5e-6.
    """
    info: dict = {}
    nf_c = ~torch.isfinite(cand.double())
    nf_o = ~torch.isfinite(oracle.double())
    info["nonfinite_match"] = bool(torch.equal(nf_c.cpu(), nf_o.cpu()))
    c = error_stats(cand, oracle)
    info.update({f"cand_{k}": v for k, v in c.items()})
    ulp = ulp_bf16(c["ref_max"])
    ok = info["nonfinite_match"] and c["cos_diff"] <= 5e-6
    if triton is not None:
        t = error_stats(triton, oracle)
        info.update({f"triton_{k}": v for k, v in t.items()})
        ok = ok and c["max_abs"] <= 2 * t["max_abs"] + ulp and c["rel_l2"] <= 2 * t["rel_l2"] + 2**-12
    else:
        ok = ok and c["max_abs"] <= bf16_tol[0] * c["ref_max"] + ulp and c["rel_l2"] <= bf16_tol[1]
    info["pass"] = bool(ok)
    return bool(ok), info


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill with NaN so that unwritten outputs are caught."""
    return t.fill_(float("nan"))


# ----------------------------------------------------------------------------- baselines
def sglang_triton_available() -> bool:
    try:
        from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd  # noqa: F401
    except Exception:
        return False
    return True


def run_sglang_triton(case: Case, out: torch.Tensor | None = None) -> torch.Tensor:
    """SGLang 0.5.23's Triton extend_attention_fwd with its target-verify arguments (CUDA)."""
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

    total, H = case.q.shape[0], case.q.shape[1]
    if out is None:
        out = torch.empty(total, H, D_V, dtype=torch.bfloat16, device=case.q.device)
    k = case.k_draft.reshape(total, 1, D_QK)
    v = k[..., :D_V]
    kvb = case.kv_buffer.reshape(-1, 1, D_QK)
    extend_attention_fwd(
        case.q,
        k,
        v,
        out,
        kvb,
        kvb[..., :D_V],
        case.qo_indptr,
        case.kv_indptr,
        case.kv_indices,
        case.custom_mask,
        True,
        case.mask_indptr,
        case.max_q_len,
        1.0,
        1.0,
        sm_scale=case.sm_scale,
    )
    return out


def run_kernel(case: Case, **kw) -> torch.Tensor:
    import mla_tree_verify

    return mla_tree_verify.tree_verify(*case.args(), max_q_len=case.max_q_len, **kw)
