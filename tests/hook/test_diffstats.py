"""The diff statistics (torch path) equal a float64 reference, NaN/Inf positions included."""

from __future__ import annotations

import math

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shadowd.hook.diffstats import TINY, empty_stats, hard_failure, stats_torch
from shadowd.wire import HIST_BINS, hist_bin_of


def reference(c: np.ndarray, b: np.ndarray) -> dict:
    """Independent float64 reference written from the definitions (elementwise, numpy)."""
    c = c.astype(np.float32).astype(np.float64).ravel()
    b = b.astype(np.float32).astype(np.float64).ravel()
    fc, fb = np.isfinite(c), np.isfinite(b)
    cmp = fc & fb
    d = np.abs((c[cmp].astype(np.float32) - b[cmp].astype(np.float32)).astype(np.float64))
    hist = [0] * HIST_BINS
    for v in d:
        hist[hist_bin_of(float(v))] += 1
    hist[-1] += int((~cmp).sum())
    out = {"numel": int(cmp.sum()), "nan_base": int(np.isnan(b).sum()), "inf_base": int(np.isinf(b).sum()),
           "nan_cand": int(np.isnan(c).sum()), "inf_cand": int(np.isinf(c).sum()),
           "cand_nonfinite": int((~fc & fb).sum()), "base_nonfinite": int((fc & ~fb).sum()), "hist": hist,
           "out_scale": float(np.abs(b[fb]).max()) if fb.any() else 0.0}
    if out["cand_nonfinite"]:
        out.update(max_abs=math.nan, mean_abs=math.nan, max_rel=math.nan, rel_l2=math.nan, cos_diff=math.nan)
        return out
    bc, cc = b[cmp], c[cmp]
    sd2, sb2, sc2 = float((d * d).sum()), float((bc * bc).sum()), float((cc * cc).sum())
    pos = np.flatnonzero(cmp)[int(np.argmax(d))] if d.size else -1
    with np.errstate(over="ignore"):  # fp32 division, as both paths do: it may overflow to inf, as theirs does
        rel = float((d.astype(np.float32) / np.maximum(np.abs(bc), TINY).astype(np.float32)).max()) if d.size else 0.0
    out.update(max_abs=float(d.max()) if d.size else 0.0, max_pos=int(pos),
               mean_abs=float(d.mean()) if d.size else 0.0,
               max_rel=rel,
               rel_l2=math.sqrt(sd2 / sb2) if sb2 > 0 else (0.0 if sd2 == 0 else math.inf),
               cos_diff=sd2 / (sc2 + sb2) if sc2 + sb2 > 0 else 0.0)
    return out


def check(got: dict, ref: dict) -> None:
    for k, v in ref.items():
        if isinstance(v, float):
            if math.isnan(v):
                assert math.isnan(got[k]), k
            else:
                assert math.isclose(got[k], v, rel_tol=1e-5, abs_tol=1e-12), (k, got[k], v)
        elif k == "max_pos":
            continue  # ties: compared separately on a unique maximum
        else:
            assert got[k] == v, (k, got[k], v)


def plant(x: torch.Tensor, g: torch.Generator, n: int, value: float) -> None:
    flat = x.view(-1)
    idx = torch.randint(0, flat.numel(), (n,), generator=g)
    flat[idx] = value


def test_random_bf16_with_nonfinite_positions() -> None:
    g = torch.Generator().manual_seed(1)
    for trial in range(20):
        b = torch.randn(33, 4, 17, generator=g).to(torch.bfloat16)
        c = (b.float() + 1e-2 * torch.randn(b.shape, generator=g)).to(torch.bfloat16)
        if trial % 2:
            plant(b, g, 3, float("nan"))
            plant(b, g, 2, float("inf"))
        if trial % 4 == 3:
            plant(c, g, 2, float("-inf"))
        got = stats_torch(c, b)
        check(got, reference(c.float().numpy(), b.float().numpy()))
        # numel counts the compared positions; the histogram's last bin the others
        assert sum(got["hist"]) == b.numel() and got["hist"][-1] == b.numel() - got["numel"]


def test_unique_max_position_and_zeros() -> None:
    b = torch.zeros(8, 8)
    c = torch.zeros(8, 8)
    c[3, 5] = 0.5
    c[1, 1] = 0.25
    s = stats_torch(c, b)
    assert s["max_pos"] == 3 * 8 + 5 and s["max_abs"] == 0.5
    assert s["hist"][0] == 62 and s["hist"][hist_bin_of(0.5)] == 1 and s["hist"][hist_bin_of(0.25)] == 1
    assert s["rel_l2"] == math.inf and s["cos_diff"] == 1.0


def test_baseline_only_nonfinite_is_not_held_against_candidate() -> None:
    b = torch.ones(4, 4)
    c = torch.ones(4, 4)
    b[0] = float("nan")  # the baseline's inexact masking (CONTEXT §4): baseline NaN, candidate finite
    s = stats_torch(c, b)
    assert s["base_nonfinite"] == 4 and s["cand_nonfinite"] == 0 and s["max_abs"] == 0.0
    assert hard_failure(s, 0.25, 0.1) is None
    c[1, 1] = float("nan")
    s = stats_torch(c, b)
    assert s["cand_nonfinite"] == 1 and math.isnan(s["max_abs"]) and hard_failure(s, 0.25, 0.1) == "nonfinite"


def test_valid_rows_exclude_padding() -> None:
    b = torch.randn(10, 6)
    c = b.clone()
    c[7:] = float("nan")  # padded rows hold garbage
    s = stats_torch(c, b, valid_numel=7 * 6)
    assert s["numel"] == 42 and s["cand_nonfinite"] == 0 and s["max_abs"] == 0.0


def test_cos_diff_does_not_cancel() -> None:
    b = torch.ones(1000, dtype=torch.float32)
    c = b + 1e-6
    s = stats_torch(c, b)
    d = float(np.float32(1 + 1e-6) - np.float32(1))
    assert math.isclose(s["cos_diff"], 1000 * d * d / (1000 * (1 + (1 + d) ** 2)), rel_tol=1e-6)


def test_empty_stats_is_a_failure() -> None:
    s = empty_stats(10)
    assert math.isnan(s["max_abs"]) and sum(s["hist"]) == 0 and hard_failure(s, 0.25, 0.1) == "nan_stat"


finite_or_not = st.one_of(st.floats(-1e4, 1e4, width=32), st.sampled_from([math.nan, math.inf, -math.inf, 0.0]))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(finite_or_not, finite_or_not), min_size=1, max_size=64))
def test_hypothesis_fp32(pairs: list[tuple[float, float]]) -> None:
    c = torch.tensor([p[0] for p in pairs], dtype=torch.float32)
    b = torch.tensor([p[1] for p in pairs], dtype=torch.float32)
    check(stats_torch(c, b), reference(c.numpy(), b.numpy()))
