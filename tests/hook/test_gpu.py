"""GPU (CUDA) tests of the fused statistics and the graph-capturable hook path; skipped without CUDA."""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from shadowd.hook.config import Sampling
from shadowd.hook.diffstats import finalize, raw_stats_torch, stats_torch
from shadowd.hook.site import Bucket, ShadowSite
from tests.hook.conftest import make_runtime
from tests.hook.test_diffstats import check, plant, reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (an H200 run)")]

ROWS, K, N = 64, 128, 256


def gpu_base(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.float() @ w.float()).to(torch.bfloat16)


def gpu_cand(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    k = x.shape[1] // 2
    lo = (x[:, :k].float() @ w[:k].float()).to(torch.bfloat16).float()
    return (lo + x[:, k:].float() @ w[k:].float()).to(torch.bfloat16)


def fused(c: torch.Tensor, b: torch.Tensor, valid: torch.Tensor | None = None) -> dict:
    from shadowd.hook.device import fused_raw_stats

    raw = fused_raw_stats(c, b, valid)
    torch.cuda.synchronize()
    return finalize(raw.cpu().tolist())


@pytest.mark.parametrize("shape,dtype", [((33, 4, 17), torch.bfloat16), ((256, 64, 512), torch.bfloat16),
                                         ((1000, 3), torch.float32), ((7, 5), torch.float16),
                                         ((2048, 8, 512), torch.bfloat16), ((64, 16, 512), torch.bfloat16)])
def test_gpu_fused_stats_match_float64(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(sum(shape))
    b = torch.randn(shape, generator=g).to(dtype)
    c = (b.float() + 1e-2 * torch.randn(shape, generator=g)).to(dtype)
    plant(b, g, 5, float("nan"))
    plant(b, g, 3, float("inf"))
    plant(c, g, 2, float("-inf"))
    plant(c, g, 7, 0.0)
    got = fused(c.cuda(), b.cuda())
    cpu = stats_torch(c, b)
    check(got, {k: v for k, v in cpu.items() if k != "max_pos"})
    if c.numel() < 100_000:
        check(got, reference(c.float().numpy(), b.float().numpy()))
    c2 = c.clone()
    c2[c2 != c2] = 0  # no candidate-only non-finite: float statistics are defined
    c2[c2.isinf()] = 0
    got2 = fused(c2.cuda(), b.cuda())
    ref2 = stats_torch(c2, b)
    check(got2, {k: v for k, v in ref2.items() if k != "max_pos"})
    assert got2["max_pos"] == ref2["max_pos"]


TILE_MODES = [((4096, 8, 2), 3), ((1024, 4, 4), 3), ((2048, 8, 2), 3), ((512, 1, 8), 3), ((1024, 2, 8), 3),
              ((8192, 16, 1), 2), ((4096, 8, 2), 2), ((4096, 8, 2), 1), ((8192, 8, 2), 3), ((4096, 4, 4), 3),
              ((4096, 4, 2), 3), ((2048, 4, 1), 3), ((2048, 4, 2), 3), ((2048, 4, 1), 4), ((2048, 4, 2), 4),
              ((4096, 8, 2), 4), ((512, 1, 8), 4), ((1024, 2, 8), 4)]


@pytest.mark.parametrize("tile,hist_mode", TILE_MODES)
def test_gpu_every_tile_and_histogram_mode_match(tile: tuple[int, int, int], hist_mode: int) -> None:
    """Every statistic, the histogram included, is the same for every tile shape and histogram mode the
    bench tries: the fast path (all finite) and the exact redo (NaN / Inf in some programs' tiles)."""
    _check_tile(tile, hist_mode, None)


@pytest.mark.parametrize("tile", [(2048, 4, 1), (2048, 4, 2), (1024, 4, 4), (4096, 8, 2)])
@pytest.mark.parametrize("ew", [True, False])
def test_gpu_fast_pass_state_per_element_and_per_row_match(tile: tuple[int, int, int], ew: bool) -> None:
    """The fast pass's running sums and maxima kept per element (the default where registers allow) or per
    row give the same statistics, on the tiles whose default is either."""
    _check_tile(tile, 3, ew)


def _check_tile(tile: tuple[int, int, int], hist_mode: int, ew: bool | None) -> None:
    from shadowd.hook.device import fused_raw_stats

    g = torch.Generator().manual_seed(tile[0] + hist_mode)
    b = torch.randn(301, 16, 512, generator=g).to(torch.bfloat16)  # a partial last tile for every tile size
    c = (b.float() + 1e-2 * torch.randn(b.shape, generator=g)).to(torch.bfloat16)
    c.view(-1)[:5000] = b.view(-1)[:5000]  # exact zeros: bin 0
    c.view(-1)[7777] += 64.0  # one large difference: a top bin and a unique max position
    for planted in (False, True):
        cc, bb = c.clone(), b.clone()
        if planted:
            plant(bb, g, 4, float("nan"))
            plant(cc, g, 3, float("inf"))
        raw = fused_raw_stats(cc.cuda(), bb.cuda(), tile=tile, hist_mode=hist_mode, ew=ew)
        torch.cuda.synchronize()
        got = finalize(raw.cpu().tolist())
        ref = stats_torch(cc, bb)
        check(got, {k: v for k, v in ref.items() if k != "max_pos"})
        assert sum(got["hist"]) == cc.numel()
        if not planted:
            assert got["max_pos"] == ref["max_pos"] == 7777


def test_gpu_max_rel_exact_where_the_fast_reciprocal_would_flush() -> None:
    """The fast path's reciprocal flushes 1/|b| to zero for |b| >= 2^126; the largest relative difference
    sitting at such values must still be reported (Σb² overflows there, so that program takes the exact
    redo) while the other programs keep the fast path."""
    g = torch.Generator().manual_seed(126)
    b = torch.randn(64, 16, 512, generator=g)
    c = b * (1 + 2.0**-22)  # relative difference <= 2^-22 everywhere ...
    b.view(-1)[:4096] = 2.0**126 * (1 + torch.rand(4096, generator=g))
    c.view(-1)[:4096] = b.view(-1)[:4096] * (1 + 2.0**-20)  # ... but 2^-20 at the huge values
    got = fused(c.cuda(), b.cuda())
    ref = reference(c.numpy(), b.numpy())
    check(got, {k: ref[k] for k in ("max_abs", "max_rel", "numel", "out_scale")})
    assert got["max_rel"] > 2.0**-21
    # and at zero or subnormal baseline values, where the fast path's reciprocal is infinite: |b| is
    # floored at TINY (2^-126), so max rel |d| is large but finite
    b2, c2 = b.clone(), c.clone()
    b2.view(-1)[:4096] = 1.0
    c2.view(-1)[:4096] = 1.0
    b2.view(-1)[100_000:100_003] = torch.tensor([0.0, -0.0, 1e-40])
    c2.view(-1)[100_000:100_003] = 2.0**-10
    got2 = fused(c2.cuda(), b2.cuda())
    ref2 = reference(c2.numpy(), b2.numpy())
    check(got2, {k: ref2[k] for k in ("max_abs", "max_rel", "numel", "out_scale")})
    assert math.isfinite(got2["max_rel"]) and got2["max_rel"] > 2.0**100


def test_gpu_padded_rows_excluded() -> None:
    b = torch.randn(40, 8, 64, device="cuda").to(torch.bfloat16)
    c = b.clone()
    c[25:] = float("nan")
    valid = torch.tensor([25], dtype=torch.int32, device="cuda")
    got = fused(c, b, valid)
    assert got["numel"] == 25 * 8 * 64 and got["cand_nonfinite"] == 0 and got["max_abs"] == 0.0


def test_gpu_pdl_stats_read_what_the_previous_kernel_wrote() -> None:
    """Launched with programmatic dependent launch (sm_90+), the statistics kernel starts before the kernel
    that writes the candidate has finished; it must still see every value that kernel wrote. Captured in a
    graph right behind a large matmul writing the candidate, replayed with new inputs each time."""
    from shadowd.hook.device import NMETA, REC, launch_stats, new_accumulator, pdl_supported

    if not pdl_supported(torch.device("cuda", torch.cuda.current_device())):
        pytest.skip("programmatic dependent launch needs sm_90+ and Triton's launch_pdl option")
    x = torch.randn(2048, 4096, device="cuda").to(torch.bfloat16)
    w = torch.randn(4096, 512, device="cuda").to(torch.bfloat16)
    b = torch.zeros(2048, 512, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(b)
    acc, rec = new_accumulator(b.device), torch.zeros(1, REC, dtype=torch.float64, device="cuda")
    seq, dstate = torch.zeros(1, dtype=torch.int64, device="cuda"), torch.zeros(8, dtype=torch.int64, device="cuda")
    sstate = torch.zeros(16, dtype=torch.int64, device="cuda")
    sstate[0] = sstate[12] = 1  # sampled, published into the one-record ring

    def step() -> None:
        torch.matmul(x, w, out=c)  # the candidate's writer: the statistics kernel's direct predecessor
        launch_stats(c, b, acc, rec, seq, sstate, dstate, publish=False)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    gen = torch.Generator(device="cuda").manual_seed(3)
    for i in range(4):
        x.copy_(torch.randn(x.shape, device="cuda", generator=gen).to(torch.bfloat16) * (i + 1))
        g.replay()
        torch.cuda.synchronize()
        got = finalize(rec[0, NMETA:].cpu().tolist())
        ref = stats_torch(c.cpu(), b.cpu())
        check(got, {k: v for k, v in ref.items() if k != "max_pos"})
        assert got["max_abs"] > 0


def _graph_site(mode: str, **cfg: object) -> tuple:
    rt, _sink = make_runtime(mode, **cfg)
    rt.sink = None
    site = ShadowSite("g", gpu_base, gpu_cand, runtime=rt)
    x = torch.randn(ROWS, K, device="cuda").to(torch.bfloat16)
    w = torch.randn(K, N, device="cuda").to(torch.bfloat16)
    valid = torch.tensor([ROWS], dtype=torch.int32, device="cuda")
    meta = torch.tensor([2, 16, 1000], dtype=torch.int64, device="cuda")
    bucket = Bucket(batch_size=2, draft_tokens=16, prefix_len=1000, heads=8, valid_rows=valid, meta=meta)
    return rt, site, x, w, valid, meta, bucket


def _capture(site: ShadowSite, x: torch.Tensor, w: torch.Tensor, bucket: Bucket, warm: int = 4):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warm):  # compiles every kernel variant outside the capture
            site(x, w, layer=0, bucket=bucket)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = site(x, w, layer=0, bucket=bucket)
    torch.cuda.synchronize()
    return g, out


def _drain(rt) -> list[dict]:
    torch.cuda.synchronize()  # the test waits; the hook never does
    return rt.device().poll()


def test_gpu_validate_graph_replay_per_replay_stats() -> None:
    rt, site, x, w, valid, meta, bucket = _graph_site("validate")
    g, out = _capture(site, x, w, bucket)
    _drain(rt)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for i in range(6):
        x.copy_(torch.randn(ROWS, K, device="cuda", generator=gen).to(torch.bfloat16))
        rows = ROWS - 7 * i
        valid.fill_(rows)
        meta.copy_(torch.tensor([1 + i, 8 + i, 100 * i], device="cuda"))
        g.replay()
        (s,) = _drain(rt)
        ref = stats_torch(gpu_cand(x, w).cpu(), gpu_base(x, w).cpu(), rows * N)
        assert torch.equal(out, gpu_base(x, w)), "validate returns the baseline's result"
        check(s, {k: v for k, v in ref.items() if k != "max_pos"})
        assert s["numel"] == rows * N and s["batch_size"] == 1 + i and s["draft_tokens"] == 8 + i
        assert s["prefix_len"] == 100 * i and s["mode"] == "validate" and s["heads"] == 8
        assert s["base_us"] is not None and s["base_us"] >= 0 and s["cand_us"] >= 0  # globaltimer deltas


def test_gpu_sampling_and_kill_switch_on_replay() -> None:
    rt, site, x, w, _valid, _meta, bucket = _graph_site("validate", sampling=Sampling(3))
    g, _out = _capture(site, x, w, bucket, warm=6)
    _drain(rt)
    steps = []
    for _ in range(9):
        g.replay()
        steps += [s["step"] for s in _drain(rt)]
    assert len(steps) == 3 and all(s % 3 == 0 for s in steps), steps
    rt.set_override("off")  # the kill switch: the control word, pushed to the device mirror replays read
    rt.device().settle_control()  # (it lands microseconds later; the test waits for it, serving never does)
    for _ in range(6):
        g.replay()
    assert _drain(rt) == []
    rt.set_override(None)
    rt.device().settle_control()
    for _ in range(3):
        g.replay()
    assert len(_drain(rt)) == 1


def test_gpu_on_mode_spot_check_and_fallback_on_replay() -> None:
    rt, site, x, w, _valid, _meta, bucket = _graph_site("on", spot_every=2)
    scale = torch.ones(1, device="cuda")
    site.candidate = lambda a, b: (gpu_cand(a, b).float() * scale).to(torch.bfloat16)
    g, out = _capture(site, x, w, bucket)
    _drain(rt)
    records = []
    for _ in range(4):
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, gpu_cand(x, w)), "on mode returns the candidate's result"
        records += _drain(rt)
    assert len(records) == 2 and all(r["mode"] == "on" for r in records) and not rt.fallback
    scale.fill_(3.0)  # the candidate goes wrong: under a graph every on-mode call is checked, so the
    outs = []          # very next replay returns the baseline, spot check or not, and so do all after it
    for _ in range(4):
        g.replay()
        torch.cuda.synchronize()
        outs.append(torch.equal(out, gpu_base(x, w)))
        _drain(rt)
    assert all(outs), outs
    assert rt.fallback and rt.producer_stats()["fallback"] == 1
    scale.fill_(1.0)  # even a good candidate is not used again: the fallback sticks
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, gpu_base(x, w))


def _sizes_gate(sizes: list[torch.Tensor]) -> Any:
    """A baseline gate like the SGLang site's: while the baseline runs, the work size it reads on the device
    (``sizes[0]``) is a copy that holds zeros on replays that gate the baseline off."""
    from shadowd.hook.device import gated_copy

    @contextlib.contextmanager
    def gate(flag: torch.Tensor, args: tuple, kwargs: dict) -> Iterator[None]:
        real = sizes[0]
        sizes[0] = gated_copy(real, flag)
        try:
            yield
        finally:
            sizes[0] = real

    return gate


def test_gpu_gated_on_mode_baseline_works_only_on_spot_checks() -> None:
    """A site with a baseline gate (as SGLang's verify site): on replays that are not spot checks the
    baseline sees zero work sizes; spot checks run it fully, and a fallback makes it serve again."""
    rt, site, x, w, _valid, _meta, bucket = _graph_site("on", spot_every=2)
    sizes = [torch.tensor([ROWS, 0], dtype=torch.int32, device="cuda")]
    worked = torch.zeros(1, dtype=torch.int64, device="cuda")

    def base_sized(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        work = sizes[0][:1] != 0  # read on the device, like SGLang's kernels read qo_indptr
        worked.add_(work.to(torch.int64))
        return (gpu_base(a, b).float() * work.float()).to(torch.bfloat16)

    gate = _sizes_gate(sizes)

    scale = torch.ones(1, device="cuda")
    site.baseline, site.baseline_gate = base_sized, gate
    site.candidate = lambda a, b: (gpu_cand(a, b).float() * scale).to(torch.bfloat16)
    g, out = _capture(site, x, w, bucket)
    _drain(rt)
    worked.zero_()
    records = []
    for _ in range(6):
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, gpu_cand(x, w)), "on mode serves the candidate"
        records += _drain(rt)
    assert int(worked) == 3, "the baseline had work on the 3 spot-check replays only"
    # a gated-off baseline would return zeros: a spot check against it would be a hard failure
    assert len(records) == 3 and not rt.fallback and all(r["rel_l2"] < 0.05 for r in records), records
    scale.fill_(3.0)  # the candidate goes wrong: the next spot check catches it and the baseline serves
    outs = []
    for _ in range(4):
        g.replay()
        torch.cuda.synchronize()
        outs.append(torch.equal(out, gpu_base(x, w)))
        _drain(rt)
    assert outs[-3:] == [True, True, True] and rt.fallback, outs


def test_gpu_gated_on_mode_raised_error_word_makes_the_next_replay_serve_the_baseline() -> None:
    """On mode with a baseline gate and no spot check in sight: once the candidate's error word is raised (by a
    replay whose output was served unchecked), the very next replay runs the baseline and serves it, the device
    falls back, and the record names the word."""
    rt, site, x, w, _valid, _meta, bucket = _graph_site("on", spot_every=1000)
    sizes = [torch.tensor([ROWS, 0], dtype=torch.int32, device="cuda")]
    worked = torch.zeros(1, dtype=torch.int64, device="cuda")
    word = torch.zeros(1, dtype=torch.int32, device="cuda")

    def base_sized(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        work = sizes[0][:1] != 0
        worked.add_(work.to(torch.int64))
        return (gpu_base(a, b).float() * work.float()).to(torch.bfloat16)

    site.baseline, site.baseline_gate = base_sized, _sizes_gate(sizes)
    site.candidate_flag = lambda d: word
    g, out = _capture(site, x, w, bucket)
    _drain(rt)
    worked.zero_()
    for _ in range(3):
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, gpu_cand(x, w)), "on mode serves the candidate"
    assert _drain(rt) == [] and int(worked) == 0, "no spot check: the baseline never worked"
    word.fill_(2)  # raised after the last replay's check: that replay's output was served unchecked
    served = []
    for _ in range(3):
        g.replay()
        torch.cuda.synchronize()
        served.append("base" if torch.equal(out, gpu_base(x, w)) else "cand")
    recs = _drain(rt)
    assert served == ["base", "base", "base"] and int(worked) == 3, (served, int(worked))
    assert [r["error"] for r in recs][:1] == ["candidate_flag:0x2"] and rt.fallback, recs


def test_gpu_gated_on_mode_served_nan_makes_the_next_replay_a_spot_check() -> None:
    """On mode with a baseline gate and no spot check in sight: a replay that serves a candidate output holding a
    NaN in a real row makes the next replay a spot check, which finds the candidate non-finite where the baseline
    is not: the baseline serves from then on. A NaN in a padded row (beyond ``valid_rows``) changes nothing."""
    rt, site, x, w, valid, _meta, bucket = _graph_site("on", spot_every=1000)
    sizes = [torch.tensor([ROWS, 0], dtype=torch.int32, device="cuda")]
    worked = torch.zeros(1, dtype=torch.int64, device="cuda")
    poison = torch.zeros(ROWS, N, dtype=torch.bfloat16, device="cuda")

    def base_sized(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        work = sizes[0][:1] != 0
        worked.add_(work.to(torch.int64))
        return (gpu_base(a, b).float() * work.float()).to(torch.bfloat16)

    site.baseline, site.baseline_gate = base_sized, _sizes_gate(sizes)
    site.candidate = lambda a, b: gpu_cand(a, b) + poison
    real = ROWS - 4
    valid.fill_(real)
    g, out = _capture(site, x, w, bucket)
    _drain(rt)
    worked.zero_()
    poison[ROWS - 1, 3] = float("nan")  # a padded row: nobody's output
    for _ in range(3):
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out[:real], gpu_cand(x, w)[:real]), "on mode serves the candidate"
    assert _drain(rt) == [] and int(worked) == 0 and not rt.fallback, "a padded row's NaN triggers nothing"
    poison[5, 3] = float("nan")  # a real row from now on
    served = []
    for _ in range(3):
        g.replay()
        torch.cuda.synchronize()
        o = out[:real]
        served.append("nan" if bool(o.isnan().any()) else "base" if torch.equal(o, gpu_base(x, w)[:real])
                      else "cand")
    recs = _drain(rt)
    assert served == ["nan", "base", "base"] and int(worked) == 2, (served, int(worked))
    assert rt.fallback and [r["cand_nonfinite"] for r in recs][:1] == [1], recs


def test_gpu_candidate_gate_runs_the_candidate_only_on_replays_that_use_it() -> None:
    """Validate at 1 in 3 under a graph with a candidate gate (as the SGLang site has): the candidate reads its
    work size through the gated copy, so it works on the sampled replays only (their statistics are the real
    candidate's) and not at all after the kill switch; the baseline's result is returned on every replay."""
    from shadowd.hook.device import RUN_CAND, gated_copy

    rt, _site, x, w, _valid, _meta, bucket = _graph_site("validate", sampling=Sampling(3))
    worked = torch.zeros(1, dtype=torch.int64, device="cuda")
    n = torch.ones(1, dtype=torch.int64, device="cuda")

    def base(x: torch.Tensor, w: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        return gpu_base(x, w)

    def cand(x: torch.Tensor, w: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        worked.add_(n)  # 1 when the gate lets the work size through, else 0
        return (gpu_cand(x, w).float() * n).to(torch.bfloat16)

    def gate(sstate: torch.Tensor, args: tuple, kwargs: dict) -> tuple:
        return (args[0], args[1], gated_copy(args[2], sstate, RUN_CAND)), kwargs

    site = ShadowSite("gate", base, cand, runtime=rt, candidate_gate=gate)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(6):
            site(x, w, n, layer=0, bucket=bucket)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = site(x, w, n, layer=0, bucket=bucket)
    _drain(rt)
    worked.zero_()
    recs = []
    for _ in range(9):
        g.replay()
        assert torch.equal(out, gpu_base(x, w))
        recs += _drain(rt)
    assert int(worked.item()) == 3 and len(recs) == 3, (int(worked.item()), len(recs))
    ref = stats_torch(gpu_cand(x, w).cpu(), gpu_base(x, w).cpu())
    for r in recs:  # the sampled replays compared the real candidate, not a gated one
        check(r, {k: v for k, v in ref.items() if k in ("max_abs", "rel_l2", "numel")})
    rt.set_override("off")
    rt.device().settle_control()
    for _ in range(6):
        g.replay()
    assert _drain(rt) == [] and int(worked.item()) == 3


def test_gpu_on_mode_with_both_gates_idles_the_candidate_while_the_baseline_serves() -> None:
    """On mode under a graph with a baseline and a candidate gate (as the SGLang site has; both made by one gate
    launch): the candidate works on every replay that serves or checks it, and sees zero work sizes while the kill
    switch or a fall-back has the baseline serve."""
    from shadowd.hook.device import RUN_CAND, gated_copy

    rt, _site, x, w, _valid, _meta, bucket = _graph_site("on", spot_every=2)
    sizes = [torch.tensor([ROWS, 0], dtype=torch.int32, device="cuda")]
    base_worked = torch.zeros(1, dtype=torch.int64, device="cuda")
    cand_worked = torch.zeros(1, dtype=torch.int64, device="cuda")
    n = torch.ones(1, dtype=torch.int64, device="cuda")
    scale = torch.ones(1, device="cuda")

    def base(a: torch.Tensor, b: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        work = sizes[0][:1] != 0  # read on the device, like SGLang's kernels read qo_indptr
        base_worked.add_(work.to(torch.int64))
        return (gpu_base(a, b).float() * work.float()).to(torch.bfloat16)

    def cand(a: torch.Tensor, b: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        cand_worked.add_(n)  # 1 when the gate lets the work size through, else 0
        return (gpu_cand(a, b).float() * n * scale).to(torch.bfloat16)

    def cgate(sstate: torch.Tensor, args: tuple, kwargs: dict) -> tuple:
        return (args[0], args[1], gated_copy(args[2], sstate, RUN_CAND)), kwargs

    site = ShadowSite("both", base, cand, runtime=rt, baseline_gate=_sizes_gate(sizes), candidate_gate=cgate)
    g, out = _capture_args(site, (x, w, n), bucket)
    _drain(rt)
    base_worked.zero_()
    cand_worked.zero_()
    for _ in range(4):
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, gpu_cand(x, w)), "on mode serves the candidate"
    assert (int(cand_worked), int(base_worked)) == (4, 2), "the candidate every replay, the baseline on spot checks"
    rt.set_override("off")
    rt.device().settle_control()
    for _ in range(3):
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, gpu_base(x, w)), "the kill switch: the baseline serves"
    assert (int(cand_worked), int(base_worked)) == (4, 5), "the candidate idles under the kill switch"
    rt.set_override(None)
    rt.device().settle_control()
    scale.fill_(3.0)  # the candidate goes wrong: the next spot check falls back
    for _ in range(3):
        g.replay()
        torch.cuda.synchronize()
    worked = int(cand_worked)
    assert torch.equal(out, gpu_base(x, w)), "fallen back"
    for _ in range(3):
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, gpu_base(x, w))
    assert int(cand_worked) == worked, "the candidate idles once the device has fallen back"
    _drain(rt)
    assert rt.fallback


def test_gpu_on_mode_serves_the_candidate_only_on_the_shapes_the_verdict_covered() -> None:
    """A promotion gate that opens on a verdict over [batch 2, tree 16, prefix bucket 10] (512-1023 tokens): under a
    graph the control kernel checks every replay's shape (read from device memory) against the covered buckets the
    gate copied to the device; other shapes are served by the baseline."""
    from shadowd.hook.coverage import Coverage

    rt, site, x, w, _valid, meta, bucket = _graph_site("on", spot_every=1000)
    meta.copy_(torch.tensor([2, 16, 1000], device="cuda"))
    g, out = _capture(site, x, w, bucket)
    _drain(rt)
    rt.open_gate("test", Coverage.from_buckets([[2, 16, 10]]))
    rt.device().settle_control()
    served = []
    for bs, t, plen in ((2, 16, 1000), (2, 16, 1024), (2, 9, 512), (2, 8, 1000), (3, 16, 1000), (1, 16, 600)):
        meta.copy_(torch.tensor([bs, t, plen], device="cuda"))
        g.replay()
        torch.cuda.synchronize()
        served.append("cand" if torch.equal(out, gpu_cand(x, w)) else "base" if torch.equal(out, gpu_base(x, w))
                      else "?")
    assert served == ["cand", "base", "cand", "base", "base", "base"], served
    assert not rt.fallback
    # counted on the device: the uncovered replays' samples carry 2 covered and 4 uncovered replays to the host
    _drain(rt)
    assert rt.device_on_calls == [2, 4], rt.device_on_calls


def test_gpu_kill_switch_from_on_to_validate_on_replay() -> None:
    """The kill switch as the streamer applies it: set on another thread, it reaches the captured graph."""
    rt, site, x, w, _valid, _meta, bucket = _graph_site("on", spot_every=1000)
    g, out = _capture(site, x, w, bucket, warm=2)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, gpu_cand(x, w))
    t = threading.Thread(target=rt.set_override, args=("validate",))
    t.start()
    t.join()
    assert not rt.device().control_dirty, "the streamer's thread pushed the word itself"
    rt.device().settle_control()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, gpu_base(x, w))
    assert [s["mode"] for s in _drain(rt)][-1:] == ["validate"]


def test_gpu_graph_captured_behind_a_held_promotion_gate_serves_the_candidate_once_it_opens() -> None:
    """On mode held at validate by the promotion gate: the graph captured meanwhile is built for on mode (with the
    baseline gate of SGLang's site), serves the baseline while the gate holds and the candidate once it opens —
    with no recapture; the opening comes from another thread, as the gate's watcher applies it."""
    rt, site, x, w, _valid, _meta, bucket = _graph_site("on", spot_every=1000, gate_run=7, url="http://c.invalid")
    assert rt.mode == "validate" and rt.capture_code == 2
    sizes = [torch.tensor([ROWS, 0], dtype=torch.int32, device="cuda")]

    def base_sized(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (gpu_base(a, b).float() * (sizes[0][:1] != 0).float()).to(torch.bfloat16)

    site.baseline, site.baseline_gate = base_sized, _sizes_gate(sizes)
    g, out = _capture(site, x, w, bucket, warm=2)
    _drain(rt)
    for _ in range(3):
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, gpu_base(x, w)), "held: the baseline is served, fully computed"
    held = _drain(rt)
    assert [r["mode"] for r in held] == ["validate"] * 3, "and compared on every sampled replay"
    t = threading.Thread(target=rt.open_gate, args=("run 7 is READY",))
    t.start()
    t.join()
    rt.device().settle_control()
    for _ in range(3):
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, gpu_cand(x, w)), "open: the same graph serves the candidate"
    assert _drain(rt) == [], "between spot checks nothing is published"


def test_gpu_control_word_changed_during_capture_reaches_replays() -> None:
    """A change made on the capturing thread (a candidate disabled during capture, say) cannot be pushed from
    there: the word's copy is captured at that point of the graph (the replay's calls after it see the change)
    and the next poll pushes it for good."""
    rt, site, x, w, _valid, _meta, bucket = _graph_site("validate")
    _g0, _ = _capture(site, x, w, bucket)  # warm every kernel variant
    ds = rt.device()
    _drain(rt)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = site(x, w, layer=0, bucket=bucket)
        rt.set_override("off")
    assert ds.control_dirty
    torch.cuda.synchronize()
    g.replay()  # its call decided before the captured copy: still validate, one record
    g.replay()  # the copy of the first replay said off: no record
    torch.cuda.synchronize()
    assert torch.equal(out, gpu_base(x, w))
    assert len(ds.poll()) == 1 and not ds.control_dirty  # (the poll pushed the word)
    rt.set_override(None)
    ds.settle_control()
    g.replay()  # the captured copy re-reads the word on every replay: validate again
    assert len(_drain(rt)) == 1


def test_gpu_on_mode_candidate_failing_during_capture_serves_the_baseline_at_once() -> None:
    """On mode with a baseline gate: a candidate that raises during capture is disabled, and the very first
    replays — before any poll has pushed the word — serve the baseline's full result at that layer, never the
    gated (idle) baseline's buffer."""
    rt, site, x, w, _valid, _meta, bucket = _graph_site("on", spot_every=1000)
    sizes = [torch.tensor([ROWS, 0], dtype=torch.int32, device="cuda")]
    outbuf = torch.zeros(ROWS, N, dtype=torch.bfloat16, device="cuda")

    def base_sized(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        work = (sizes[0][:1] != 0).to(torch.bfloat16)  # read on the device, like SGLang's kernels
        outbuf.mul_(1 - work).add_(gpu_base(a, b) * work)  # an idle baseline leaves its buffer as it was
        return outbuf

    gate = _sizes_gate(sizes)

    fail = [False]

    def cand(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if fail[0]:
            raise RuntimeError("candidate refuses this shape")
        return gpu_cand(a, b)

    site.baseline, site.baseline_gate, site.candidate = base_sized, gate, cand
    _capture(site, x, w, bucket)  # warm, with a working candidate
    _drain(rt)
    fail[0] = True
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = site(x, w, layer=0, bucket=bucket)
    assert rt.disabled and rt.device().control_dirty
    for _ in range(3):
        outbuf.zero_()
        x.copy_(torch.randn(ROWS, K, device="cuda").to(torch.bfloat16))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, gpu_base(x, w)), "the baseline's full result, from the first replay on"


def test_gpu_no_host_sync_on_the_serving_path() -> None:
    rt, site, x, w, valid, meta, bucket = _graph_site("validate")
    g, _out = _capture(site, x, w, bucket)
    eager = Bucket(batch_size=2, draft_tokens=16, prefix_len=1000, heads=8, valid_rows=valid, meta=meta)
    site.oracle = gpu_oracle  # eager calls also sample the oracle (it reads nothing on the host)
    rt.config.oracle_every = 2
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronising CUDA call raises
    try:
        for _ in range(20):
            site(x, w, layer=0, bucket=eager)  # eager validate, sampled every step
            g.replay()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    samples = _drain(rt)
    assert len(samples) >= 40
    assert sum(s["oracle_cand_err"] is not None for s in samples) == 10


def gpu_oracle(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.float() @ w.float()


def test_gpu_eager_oracle_sampling_records_both_sides_errors() -> None:
    rt, _sink = make_runtime("validate", oracle_every=2)
    site = ShadowSite("g", gpu_base, gpu_cand, oracle=gpu_oracle, runtime=rt)
    gen = torch.Generator(device="cuda").manual_seed(5)
    xs = [torch.randn(ROWS, K, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(4)]
    w = torch.randn(K, N, device="cuda", generator=gen).to(torch.bfloat16)
    valid = torch.tensor([ROWS - 9], dtype=torch.int32, device="cuda")
    bucket = Bucket(batch_size=1, draft_tokens=8, heads=8, valid_rows=valid)
    outs = [site(x, w, layer=0, bucket=bucket) for x in xs]
    samples = _drain(rt)
    assert len(samples) == 4, "the oracle's records are merged into their call's sample, never samples"
    for i, (x, out, s) in enumerate(zip(xs, outs, samples, strict=True)):
        assert torch.equal(out, gpu_base(x, w))
        real = (ROWS - 9) * N
        ref, base, cand = (f(x, w).reshape(-1)[:real].float() for f in (gpu_oracle, gpu_base, gpu_cand))
        check(s, {k: v for k, v in stats_torch(cand.cpu(), base.cpu()).items() if k != "max_pos"})
        if i % 2 == 0:  # 1 in 2 sampled calls: the second and the fourth
            assert s["oracle_cand_err"] is None and s["oracle_base_err"] is None
        else:  # exactly the fp32 max |side - oracle| over the real rows
            assert s["oracle_cand_err"] == float((cand - ref).abs().max())
            assert s["oracle_base_err"] == float((base - ref).abs().max())
            assert s["oracle_cand_err"] > 0 and s["oracle_base_err"] > 0


def test_gpu_eager_oracle_faults_never_reach_serving() -> None:
    def raising(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("oracle broke")

    def nan_oracle(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ref = gpu_oracle(x, w)
        ref[3, 5] = float("nan")
        return ref

    x = torch.randn(ROWS, K, device="cuda").to(torch.bfloat16)
    w = torch.randn(K, N, device="cuda").to(torch.bfloat16)
    for oracle, expect_nan in ((raising, None), (lambda x, w: gpu_oracle(x, w)[:, :7], None), (nan_oracle, True)):
        rt, _sink = make_runtime("validate", oracle_every=1)
        site = ShadowSite("g", gpu_base, gpu_cand, oracle=oracle, runtime=rt)
        assert torch.equal(site(x, w, layer=0), gpu_base(x, w))
        (s,) = _drain(rt)
        assert s["error"] is None and s["max_abs"] > 0  # the call's own statistics are untouched
        if expect_nan is None:  # raised, or the wrong shape: no oracle errors, the fault counted
            assert s["oracle_cand_err"] is None and site.errors["oracle"] == 1
        else:
            assert math.isnan(s["oracle_cand_err"]) and math.isnan(s["oracle_base_err"])


def test_gpu_eager_oracle_writing_into_out_never_changes_the_result() -> None:
    # baseline and oracle share the signature: an oracle that writes its fp32 answer into the ``out`` buffer the
    # baseline returned (and into x) gets copies, so the caller's result and inputs stay the baseline's
    def base_into(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return out.copy_(gpu_base(x, w))

    def oracle_into(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        out.fill_(7.0)
        x.zero_()
        return gpu_oracle(x, w)

    rt, _sink = make_runtime("validate", oracle_every=1)
    site = ShadowSite("g", base_into, lambda x, w, out: gpu_cand(x, w), oracle=oracle_into, runtime=rt)
    x = torch.randn(ROWS, K, device="cuda").to(torch.bfloat16)
    w = torch.randn(K, N, device="cuda").to(torch.bfloat16)
    x0, out = x.clone(), torch.empty(ROWS, N, dtype=torch.bfloat16, device="cuda")
    got = site(x, w, out=out, layer=0)
    assert torch.equal(got, gpu_base(x0, w)) and torch.equal(out, gpu_base(x0, w)) and torch.equal(x, x0)
    (s,) = _drain(rt)
    assert s["error"] is None and s["oracle_base_err"] is not None and site.oracle_off is None


def _bundles_after_polls(rt, root) -> list:
    for _ in range(3):  # start the snapshot's host copies, then finish it (the streamer's thread does this)
        torch.cuda.synchronize()
        rt.device().poll()
    return sorted(root.iterdir()) if root.exists() else []


def test_gpu_eager_failing_call_is_bundled_without_a_host_sync(tmp_path) -> None:
    from safetensors.torch import load_file

    rt, _sink = make_runtime("validate", bundle_dir=tmp_path / "b")
    site = ShadowSite("g", gpu_base, lambda *a: 1 / 0, runtime=rt)
    x = torch.randn(ROWS, K, device="cuda").to(torch.bfloat16)
    w = torch.randn(K, N, device="cuda").to(torch.bfloat16)
    site(x, w, layer=0)  # compiles the kernels
    _bundles_after_polls(rt, tmp_path / "b")
    x2 = torch.randn(ROWS, K, device="cuda").to(torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = site(x2, w, layer=0)  # the snapshot is taken on the serving thread: device copies only
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(out, gpu_base(x2, w))
    x2.fill_(0)  # serving overwrites its buffers: the bundle holds the call's inputs as they were
    bundles = _bundles_after_polls(rt, tmp_path / "b")
    assert len(bundles) == 2 and "exception_ZeroDivisionError" in bundles[1].name
    t = load_file(str(bundles[1] / "tensors.safetensors"))
    assert torch.equal(t["arg.1"], w.cpu()) and t["arg.0"].abs().sum() > 0
    assert torch.equal(t["out.baseline"], gpu_base(t["arg.0"].cuda(), w).cpu()) and "out.candidate" not in t


def test_gpu_numeric_breach_arms_the_next_call_which_is_bundled(tmp_path) -> None:
    from safetensors.torch import load_file

    from shadowd.hook.capture import ARM_TRIES

    bias = torch.zeros(1, device="cuda")

    def drifting(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (gpu_cand(x, w).float() + bias).to(torch.bfloat16)

    rt, _sink = make_runtime("validate", bundle_dir=tmp_path / "b")
    site = ShadowSite("g", gpu_base, drifting, runtime=rt)
    w = torch.randn(K, N, device="cuda").to(torch.bfloat16)
    xs = [torch.randn(ROWS, K, device="cuda").to(torch.bfloat16) for _ in range(3 + ARM_TRIES)]
    bias.fill_(1.0)
    site(xs[0], w, layer=0)  # breaches: nothing can be saved (its inputs are gone by the time it is seen)
    assert _bundles_after_polls(rt, tmp_path / "b") == []  # ... but it arms the site
    torch.cuda.set_sync_debug_mode("error")
    try:
        site(xs[1], w, layer=0)  # armed: snapshotted, and it breaches too
    finally:
        torch.cuda.set_sync_debug_mode(0)
    (bundle,) = _bundles_after_polls(rt, tmp_path / "b")
    t = load_file(str(bundle / "tensors.safetensors"))
    assert torch.equal(t["arg.0"], xs[1].cpu()) and torch.equal(t["out.candidate"], drifting(xs[1], w).cpu())
    assert "tolerance" in bundle.name or "rel_l2" in bundle.name or "max_abs" in bundle.name
    # armed again by the next breach, then the candidate recovers: ARM_TRIES snapshots, none saved, disarmed
    site(xs[2], w, layer=0)
    _bundles_after_polls(rt, tmp_path / "b")
    bias.fill_(0.0)
    caps = rt.device().captures
    before = caps.dropped
    for x in xs[3:]:
        site(x, w, layer=0)
        _bundles_after_polls(rt, tmp_path / "b")
    assert caps.dropped - before == ARM_TRIES and caps.saved == 1
    assert not caps.wants(0) and len(_bundles_after_polls(rt, tmp_path / "b")) == 1


def test_gpu_on_mode_hard_failure_is_bundled_after_the_fallback(tmp_path) -> None:
    import json

    from safetensors.torch import load_file

    def bad(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (gpu_cand(x, w).float() + 4.0).to(torch.bfloat16)

    rt, _sink = make_runtime("on", spot_every=1, bundle_dir=tmp_path / "b")
    site = ShadowSite("g", gpu_base, bad, runtime=rt)
    w = torch.randn(K, N, device="cuda").to(torch.bfloat16)
    xs = [torch.randn(ROWS, K, device="cuda").to(torch.bfloat16) for _ in range(3)]
    assert torch.equal(site(xs[0], w, layer=0), gpu_base(xs[0], w))  # the spot check fails: baseline served
    assert _bundles_after_polls(rt, tmp_path / "b") == [] and rt.fallback  # the ring: fall back, and arm
    # fallen back: the baseline is served; the armed site runs the candidate once more, only for the bundle
    assert torch.equal(site(xs[1], w, layer=0), gpu_base(xs[1], w))
    (bundle,) = _bundles_after_polls(rt, tmp_path / "b")
    t = load_file(str(bundle / "tensors.safetensors"))
    assert torch.equal(t["arg.0"], xs[1].cpu()) and torch.equal(t["out.candidate"], bad(xs[1], w).cpu())
    assert json.loads((bundle / "meta.json").read_text())["sample"]["mode"] == "on"
    assert torch.equal(site(xs[2], w, layer=0), gpu_base(xs[2], w))  # disarmed once saved: baseline only
    assert rt.device().captures.taken == 1


def test_gpu_candidate_exception_during_eager_call_is_a_sample() -> None:
    rt, sink = make_runtime("validate")
    site = ShadowSite("g", gpu_base, lambda *a: 1 / 0, runtime=rt)
    x = torch.randn(ROWS, K, device="cuda").to(torch.bfloat16)
    w = torch.randn(K, N, device="cuda").to(torch.bfloat16)
    out = site(x, w, layer=0)
    assert torch.equal(out, gpu_base(x, w)) and sink[0]["error"] == "exception:ZeroDivisionError"
    assert math.isnan(sink[0]["max_abs"])


def test_gpu_raw_torch_matches_fused_on_device_tensors() -> None:
    b = torch.randn(300, 7, device="cuda")
    c = b + 1e-3 * torch.randn(300, 7, device="cuda")
    raw = raw_stats_torch(c.cpu(), b.cpu())
    check(fused(c, b), {k: v for k, v in finalize(raw.tolist()).items() if k != "max_pos"})


def test_gpu_clone_many_copies_every_kind_of_input_privately() -> None:
    """The candidate's input copies (one launch for the dense word-sized ones): equal values, dtypes, shapes and
    strides, separate memory, for the argument kinds of the SGLang site — bf16 q, a draft k and its strided v
    view, int32 indices, an odd-length bool mask, int64 pointers, an empty tensor — and views at offsets."""
    from shadowd.hook.copies import clone_many

    k = torch.randn(7, 1, 576, device="cuda").to(torch.bfloat16)
    xs = [torch.randn(7, 8, 576, device="cuda").to(torch.bfloat16), k, k[..., :512],
          torch.randn(64, 8, 576, device="cuda").to(torch.bfloat16),  # 590 KB: ten pieces
          torch.randint(0, 1 << 30, (4099,), dtype=torch.int32, device="cuda"),
          torch.rand(37, device="cuda") < 0.5, torch.arange(9, dtype=torch.int64, device="cuda"),
          torch.empty(0, 576, device="cuda"), torch.arange(64, dtype=torch.int32, device="cuda")[5:50],
          torch.arange(64, dtype=torch.uint8, device="cuda")[3:35], k.reshape(-1)[1:9]]  # offsets off the word
    before = [x.clone() for x in xs]
    ys = clone_many(xs)
    for x, y, b in zip(xs, ys, before, strict=True):
        assert y.dtype == x.dtype and y.shape == x.shape and torch.equal(y, b)
        assert y.stride() == x.stride() or (y.is_contiguous() and not x.is_contiguous())
        assert y.numel() == 0 or y.data_ptr() != x.data_ptr()
    for y in ys:  # writing the copies leaves the inputs untouched
        y.zero_() if y.dtype != torch.bool else y.fill_(True)
    assert all(torch.equal(x, b) for x, b in zip(xs, before, strict=True))


def test_gpu_gated_copies_two_tensors_in_one_launch() -> None:
    """A gate's qo_indptr and kv_indptr (different dtypes) gated together: copies when the side runs, zeros when
    it is gated off, the sources untouched."""
    from shadowd.hook.device import RUN_BASE, RUN_CAND, gated_copies

    qo = torch.arange(0, 40, 8, dtype=torch.int32, device="cuda")
    kv = torch.arange(0, 5000, 1000, dtype=torch.int64, device="cuda")
    sstate = torch.zeros(16, dtype=torch.int64, device="cuda")
    sstate[RUN_BASE] = 1
    a, b = gated_copies([qo, kv], sstate, RUN_BASE)
    c, d = gated_copies([qo, kv], sstate, RUN_CAND)
    assert torch.equal(a, qo) and torch.equal(b, kv) and a.dtype == qo.dtype and b.dtype == kv.dtype
    assert int(c.abs().sum()) == 0 and int(d.abs().sum()) == 0 and c.shape == qo.shape and d.shape == kv.shape
    (three,) = gated_copies([qo], sstate, RUN_BASE)
    assert torch.equal(three, qo) and int(qo[-1]) == 32 and int(kv[-1]) == 4000
    with pytest.raises(ValueError, match="word"):
        gated_copies([qo], sstate, 3)


CYCLES = 1_000_000  # torch.cuda._sleep: >= 505 µs at the H200's highest SM clock (1980 MHz)
# the bounds leave room for host gaps of eager launches (a first version, 1400 / 300 µs, failed 1 run in 4) and
# still tell the cases apart: the oracle's 3 * CYCLES inside the candidate's time would make it >= 2020 µs, the
# candidate's sleep inside the baseline's >= 505 µs
CAND_US, BASE_US = (400, 1900), 450


def test_gpu_candidate_time_ends_where_the_candidate_does() -> None:
    """The record's candidate time runs from the baseline's end to the candidate's end: eagerly a stamp kernel
    right after the candidate (an oracle call's oracle, run before the statistics, is not the candidate's
    time); on replay the statistics kernel's start."""
    def slow_cand(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(CYCLES)
        return gpu_cand(x, w)

    def slow_oracle(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(3 * CYCLES)
        return gpu_oracle(x, w)

    rt, site, x, w, _valid, _meta, bucket = _graph_site("validate")
    site.candidate, site.oracle = slow_cand, slow_oracle
    for _ in range(2):  # compiles every kernel (a first call's times include the host's compiles)
        site(x, w, layer=0, bucket=bucket)
    _drain(rt)
    rt.config.oracle_every = 2
    for _ in range(4):  # eager: calls 2 and 4 run the oracle
        site(x, w, layer=0, bucket=bucket)
    eager = _drain(rt)
    assert len(eager) == 4 and sum(s["oracle_cand_err"] is not None for s in eager) == 2
    for s in eager:
        assert CAND_US[0] <= s["cand_us"] < CAND_US[1] and s["base_us"] < BASE_US, (s["cand_us"], s["base_us"])
    rt.config.oracle_every = 0
    g, _ = _capture(site, x, w, bucket)
    _drain(rt)
    for _ in range(3):
        g.replay()
    replayed = _drain(rt)
    assert len(replayed) == 3, replayed
    for s in replayed:
        assert CAND_US[0] <= s["cand_us"] < CAND_US[1] and s["base_us"] < BASE_US, (s["cand_us"], s["base_us"])


def test_gpu_kernel_error_flag_reaches_the_hook_eager_and_on_replay() -> None:
    """The kernel clamps an out-of-range ``kv_indices`` entry and raises a bit of its ``error_flag``; the hook reads
    that word in the statistics kernel (no host synchronisation) and reports it: the sample's error names it, the
    candidate is disabled with the bits in words, the baseline's result is what the call returned. Eagerly, and on
    a graph replay whose inputs went bad after capture."""
    mtv = pytest.importorskip("mla_tree_verify")
    from mla_tree_verify import testing

    case = testing.make_case([300, 77], [5, 3], 4, seed=11, device="cuda", tree_kind="random")
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")

    def base(*a: Any) -> torch.Tensor:
        return mtv.tree_verify(*a, max_q_len=5)

    def cand(*a: Any) -> torch.Tensor:
        return mtv.tree_verify(*a, max_q_len=5, error_flag=flag)

    def describe(v: int) -> str:
        return "; ".join(mtv.decode_error_flag(v))

    args = case.args()
    rows = torch.tensor([case.q.shape[0]], dtype=torch.int32, device="cuda")
    bucket = Bucket(batch_size=2, draft_tokens=5, prefix_len=300, heads=4, valid_rows=rows)
    for graph in (False, True):
        flag.zero_()
        rt, _sink = make_runtime("validate", sampling=Sampling(1))
        site = ShadowSite("mtv", base, cand, runtime=rt, candidate_flag=lambda d: flag, describe_flag=describe,
                          shared=(2,))
        kvi = case.kv_indices
        good = kvi.clone()
        if graph:
            g, out = _capture_args(site, args, bucket)
            _drain(rt)
            g.replay()
            assert [r["error"] for r in _drain(rt)] == [None] and not rt.disabled, "in range: nothing raised"
            kvi[7] = case.kv_buffer.shape[0] + 5  # the same index tensor the graph reads, now out of range
            g.replay()
        else:
            kvi[7] = case.kv_buffer.shape[0] + 5
            out = site(*args, layer=0, bucket=bucket)
        recs = _drain(rt)
        assert [r["error"] for r in recs] == ["candidate_flag:0x1"], recs
        assert rt.disabled and "kv_indices entry outside" in rt.disabled_reason, rt.disabled_reason
        assert torch.equal(out, base(*args)), "the call returned the baseline's result"
        assert int(flag) == 1
        kvi.copy_(good)


def test_gpu_eager_on_mode_error_word_between_spot_checks_reaches_the_host_without_a_sync() -> None:
    """Eager on mode, no spot check in sight: the real kernel given an out-of-range ``kv_indices`` entry raises its
    word on an unchecked call (served: nothing has compared it); the pinned copy made after that step's call brings
    the word to the host, and the calls after it serve the baseline — no synchronising CUDA call on the way."""
    mtv = pytest.importorskip("mla_tree_verify")
    from mla_tree_verify import testing

    case = testing.make_case([300, 77], [5, 3], 4, seed=12, device="cuda", tree_kind="random")
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")

    def base(*a: Any) -> torch.Tensor:
        return mtv.tree_verify(*a, max_q_len=5)

    calls = [0]

    def cand(*a: Any) -> torch.Tensor:
        # the site's first call is checked (it learns the output's shape there): the kernel's own output; then twice
        # it, so which side was served is visible
        calls[0] += 1
        out = mtv.tree_verify(*a, max_q_len=5, error_flag=flag)
        return out if calls[0] == 1 else (out.float() * 2).to(torch.bfloat16)

    def twice(*a: Any) -> torch.Tensor:
        return (base(*a).float() * 2).to(torch.bfloat16)

    args = case.args()
    bucket = Bucket(batch_size=2, draft_tokens=5, prefix_len=300, heads=4, valid_rows=int(case.q.shape[0]))
    rt, _sink = make_runtime("on", spot_every=1000)
    site = ShadowSite("mtv", base, cand, runtime=rt, candidate_flag=lambda d: flag,
                      describe_flag=lambda v: "; ".join(mtv.decode_error_flag(v)))
    assert torch.equal(site(*args, layer=0, bucket=bucket), base(*args)), "the first call: checked, passed"
    assert torch.equal(site(*args, layer=0, bucket=bucket), twice(*args)), "unchecked: the candidate served"
    case.kv_indices[7] = case.kv_buffer.shape[0] + 5
    served = []
    for _ in range(3):
        torch.cuda.synchronize()  # (the test lets each call's copy land; serving never waits for it)
        torch.cuda.set_sync_debug_mode("error")  # any synchronising CUDA call in the hook raises
        try:
            served.append(site(*args, layer=0, bucket=bucket))  # the first raises the word and is served
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert int(flag) == 1
    assert torch.equal(served[0], twice(*args)), "the call that raised the word was served unchecked"
    assert [torch.equal(o, base(*args)) for o in served[1:]] == [True, True], "after the word: the baseline served"
    assert rt.fallback and rt.disabled and "kv_indices entry outside" in rt.disabled_reason, rt.disabled_reason


def test_gpu_eager_on_mode_nonfinite_word_makes_the_next_step_a_checked_one() -> None:
    """Eager on mode, no spot check in sight: the real kernel writes a NaN (its KV holds one that the baseline's does
    not) and raises its non-finite word; the per-step copy brings the word to the host, the next step is checked
    whole, the check finds the candidate non-finite where the baseline is not, and the baseline serves from then on —
    no synchronising CUDA call on the way."""
    mtv = pytest.importorskip("mla_tree_verify")
    from mla_tree_verify import testing

    case = testing.make_case([300, 77], [5, 3], 4, seed=14, device="cuda", tree_kind="random")
    words = torch.zeros(2, dtype=torch.int32, device="cuda")
    poisoned = case.kv_buffer.clone()
    poisoned[int(case.kv_indices[7])] = float("nan")  # a prefix row of request 0: visible to its every draft
    kv = [case.kv_buffer]

    def base(*a: Any) -> torch.Tensor:
        return mtv.tree_verify(*a, max_q_len=5)

    def cand(q: Any, k: Any, _kv: Any, *a: Any) -> torch.Tensor:
        return mtv.tree_verify(q, k, kv[0], *a, max_q_len=5, error_flag=words[:1], nonfinite_flag=words[1:])

    args = case.args()
    bucket = Bucket(batch_size=2, draft_tokens=5, prefix_len=300, heads=4, valid_rows=int(case.q.shape[0]))
    rt, _sink = make_runtime("on", spot_every=1000)
    site = ShadowSite("mtv", base, cand, runtime=rt, candidate_flag=lambda d: words)
    # (the first call is checked — the site learns the output's shape — and passes: one clean record)
    assert torch.equal(site(*args, layer=0, bucket=bucket), base(*args)), "the candidate served"
    kv[0] = poisoned
    served, records = [], []
    for _ in range(4):
        torch.cuda.synchronize()  # (the test lets each step's copy land and drains the ring; serving never waits)
        records += rt.device().poll()
        torch.cuda.set_sync_debug_mode("error")  # any synchronising CUDA call in the hook raises
        try:
            served.append(site(*args, layer=0, bucket=bucket))
        finally:
            torch.cuda.set_sync_debug_mode(0)
    records += _drain(rt)
    kinds = ["nan" if bool(o.isnan().any()) else "base" if torch.equal(o, base(*args)) else "?" for o in served]
    # the first NaN step raises the word, the next sees it (one layer per step here), the one after is checked
    assert kinds == ["nan", "nan", "base", "base"], kinds
    assert rt.fallback and not rt.disabled and [r["cand_nonfinite"] > 0 for r in records] == [False, True], records


def _capture_args(site: ShadowSite, args: tuple, bucket: Bucket, warm: int = 3) -> tuple[torch.cuda.CUDAGraph, Any]:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warm):
            site(*args, layer=0, bucket=bucket)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = site(*args, layer=0, bucket=bucket)
    torch.cuda.synchronize()
    return g, out
