"""Candidates and call sites built to break the hook's promises on the CPU path: aliasing, inputs written through
containers or copies, several sites on one runtime, outputs the on mode cannot inspect, BaseExceptions."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shadowd.hook.config import Sampling
from shadowd.hook.site import Bucket, ShadowSite
from tests.hook.conftest import base_fn, cand_fn, inputs, make_runtime


def test_validate_returns_the_baseline_even_when_its_result_lives_in_a_buffer_the_candidate_gets() -> None:
    # The baseline writes into an output buffer it is given (shared: not cloned) and returns it; the candidate
    # writes into the same buffer, once through a torch in-place op and once through .data (no version bump).
    # The caller must get the baseline's numbers either way (it got the candidate's).
    def baseline(x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        torch.mul(x, 2, out=o)
        return o

    def in_place(x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        o.fill_(3)
        return x * 2

    def through_data(x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        o.data.copy_(torch.full_like(o, 3))
        return x * 2

    for cand in (in_place, through_data):
        rt, sink = make_runtime("validate")
        x, o = torch.ones(4), torch.zeros(4)
        out = ShadowSite("s", baseline, cand, runtime=rt, shared=(1,))(x, o, layer=0)
        assert torch.equal(out, torch.full((4,), 2.0)), cand.__name__
    # the in-place write is also found out (the .data write is beyond the version counter: README says so)
    rt, sink = make_runtime("validate")
    ShadowSite("s", baseline, in_place, runtime=rt, shared=(1,))(torch.ones(4), torch.zeros(4), layer=0)
    assert sink[0]["error"] == "input_modified" and rt.disabled


def test_tensors_inside_lists_and_dicts_are_protected_too() -> None:
    def baseline(x: torch.Tensor, kv: list[torch.Tensor], extra: dict[str, torch.Tensor]) -> torch.Tensor:
        return x + kv[0].sum() + extra["k"].sum()

    def scribbler(x: torch.Tensor, kv: list[torch.Tensor], extra: dict[str, torch.Tensor]) -> torch.Tensor:
        kv[0].zero_()
        extra["k"].fill_(7)
        return baseline(x, kv, extra)

    rt, sink = make_runtime("validate")
    x, kv, extra = torch.ones(3), [torch.ones(5), torch.ones(2)], {"k": torch.ones(4)}
    out = ShadowSite("s", baseline, scribbler, runtime=rt)(x, kv, extra, layer=0)
    assert torch.equal(kv[0], torch.ones(5)) and torch.equal(extra["k"], torch.ones(4)), "the caller's tensors"
    assert torch.equal(out, torch.full((3,), 10.0))
    assert sink[0]["error"] == "input_modified" and rt.disabled


def test_a_second_site_name_on_one_runtime_is_reported_once(caplog: pytest.LogCaptureFixture) -> None:
    # samples carry no site name: two differently named sites of one process are judged together, which the
    # hook says (once) rather than letting the user find out from a verdict over mixed statistics
    rt, _sink = make_runtime("validate")
    with caplog.at_level("WARNING", logger="shadowd.hook"):
        ShadowSite("attn", base_fn, cand_fn, runtime=rt)
        ShadowSite("attn", base_fn, cand_fn, runtime=rt)  # the same site made again (a plugin reloaded): silent
        assert not [r for r in caplog.records if "share one runtime and so one run" in r.getMessage()]
        ShadowSite("mlp", base_fn, cand_fn, runtime=rt)
        ShadowSite("moe", base_fn, cand_fn, runtime=rt)
    said = [r.getMessage() for r in caplog.records if "share one runtime and so one run" in r.getMessage()]
    assert len(said) == 1 and "'attn', 'mlp'" in said[0] and "HookRuntime.from_env(run_key=...)" in said[0], said
    assert rt.site_names == {"attn", "mlp", "moe"}


def test_two_sites_on_one_runtime_sample_every_layer_of_a_sampled_step() -> None:
    # attention and MLP of the same layers, both first_layer 0, sampling 1 in 2: the step advanced twice per model
    # step, so attention layer 0 was never sampled and the other pairs always
    rt, sink = make_runtime("validate", sampling=Sampling(2))
    attn = ShadowSite("attn", base_fn, cand_fn, runtime=rt)
    mlp = ShadowSite("mlp", base_fn, cand_fn, runtime=rt)
    x, w = inputs()
    for _ in range(10):
        for layer in range(3):
            attn(x, w, layer=layer)
            mlp(x, w, layer=layer)
    assert rt.step == 10
    assert len(sink) == 5 * 3 * 2, "half the steps, every layer of both sites"
    assert sorted({s["step"] for s in sink}) == [2, 4, 6, 8, 10]
    # a site that replaces the first one once it is gone (a plugin reloaded) takes the step over
    del attn
    again = ShadowSite("attn", base_fn, cand_fn, runtime=rt)
    again(x, w, layer=0)
    mlp(x, w, layer=0)
    assert rt.step == 11
    # so does one whose owner is alive but no longer called (the step froze, and sampling with it)
    for _ in range(5):
        mlp(x, w, layer=0)
    assert rt.step == 16


def test_on_mode_serves_only_outputs_like_the_baselines() -> None:
    # the first call is checked (the site learns what the output looks like); later unchecked calls whose output
    # has another shape or dtype, or is no tensor, are never served: the baseline is, and the process falls back
    for bad, why in (((lambda x, w: cand_fn(x, w)[:1]), "shape"), ((lambda x, w: cand_fn(x, w).float()), "dtype"),
                     ((lambda x, w: (cand_fn(x, w),)), "type")):
        rt, sink = make_runtime("on", spot_every=1000)
        calls = {"n": 0}

        def candidate(x: torch.Tensor, w: torch.Tensor, bad: Any = bad, calls: dict[str, int] = calls) -> Any:
            calls["n"] += 1
            return cand_fn(x, w) if calls["n"] == 1 else bad(x, w)

        site = ShadowSite("s", base_fn, candidate, runtime=rt)
        x, w = inputs()
        outs = [site(x, w, layer=0) for _ in range(3)]
        assert torch.equal(outs[0], cand_fn(x, w)) and [s["error"] for s in sink] == [None]
        assert all(torch.equal(o, base_fn(x, w)) for o in outs[1:]), why
        assert rt.fallback and why in (rt.fallback_reason or ""), (why, rt.fallback_reason)


def test_on_mode_an_output_it_cannot_inspect_falls_back_without_raising() -> None:
    # a meta tensor: torch.isfinite on it raises; that must not reach serving
    rt, _sink = make_runtime("on", spot_every=1000)
    calls = {"n": 0}

    def candidate(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        out = cand_fn(x, w)
        return out if calls["n"] == 1 else out.to("meta")

    site = ShadowSite("s", base_fn, candidate, runtime=rt)
    x, w = inputs()
    site(x, w, layer=0)
    assert torch.equal(site(x, w, layer=0), base_fn(x, w)) and rt.fallback


def test_on_mode_a_candidate_writing_its_inputs_is_found_on_unchecked_calls() -> None:
    rt, _sink = make_runtime("on", spot_every=1000)
    calls = {"n": 0}

    def candidate(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] > 1:
            x.mul_(0.5)  # pre-scales its input in place and compensates: right answer, caller's q changed
            return (cand_fn(x, w).float() * 2).to(torch.bfloat16)
        return cand_fn(x, w)

    site = ShadowSite("s", base_fn, candidate, runtime=rt)
    x, w = inputs()
    site(x, w, layer=0)
    site(x, w, layer=0)
    assert rt.fallback and rt.disabled and "modified its inputs" in (rt.disabled_reason or "")


def test_on_mode_nan_in_padded_rows_is_not_a_failure() -> None:
    rt, _sink = make_runtime("on", spot_every=1000)

    def candidate(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = cand_fn(x, w)
        out[2:] = float("nan")  # rows past the real ones: padding the caller drops
        return out

    site = ShadowSite("s", base_fn, candidate, runtime=rt)
    x, w = inputs()
    for _ in range(4):
        site(x, w, layer=0, bucket=Bucket(valid_rows=2))
    assert not rt.fallback, rt.fallback_reason


class Odd(BaseException):
    pass


@pytest.mark.parametrize("exc", [GeneratorExit(), Odd()])
def test_a_candidate_raising_a_base_exception_becomes_a_sample(exc: BaseException) -> None:
    def candidate(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        raise exc

    rt, sink = make_runtime("validate")
    x, w = inputs()
    out = ShadowSite("s", base_fn, candidate, runtime=rt)(x, w, layer=0)
    assert torch.equal(out, base_fn(x, w)) and sink[0]["error"] == f"exception:{type(exc).__name__}"


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
def test_ctrl_c_or_a_sigterm_exit_while_the_candidate_runs_still_stops_the_process(exc: type) -> None:
    # (a SIGTERM handler that calls sys.exit raises SystemExit wherever the main thread is: often in the candidate)
    def candidate(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        raise exc

    rt, _sink = make_runtime("validate")
    x, w = inputs()
    with pytest.raises(exc):
        ShadowSite("s", base_fn, candidate, runtime=rt)(x, w, layer=0)
    assert rt.candidate_failures == 0


def test_an_on_mode_site_remembers_its_latest_output_keys() -> None:
    # past the bound the oldest key goes: keys past it were never learnt, so every call of theirs was compared
    from shadowd.hook.arguments import OUT_KEYS_MAX

    rt, _sink = make_runtime("on", spot_every=10**9)
    base_calls = []

    def base(x: torch.Tensor) -> torch.Tensor:
        base_calls.append(1)
        return x * 2

    site = ShadowSite("s", base, lambda x: x * 2, runtime=rt)
    for k in range(1, OUT_KEYS_MAX + 1):  # fills the bound (each first call checked)
        site(torch.ones(2, k), layer=0)
    base_calls.clear()
    for _ in range(3):
        for k in range(OUT_KEYS_MAX + 1, OUT_KEYS_MAX + 11):  # ten new keys, three times
            site(torch.ones(2, k), layer=0)
    assert len(base_calls) == 10, "each new key checked once, then learnt"
    assert len(site.out_metas) == OUT_KEYS_MAX
