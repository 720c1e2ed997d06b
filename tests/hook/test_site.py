"""Each mode's contract on CPU: off, validate, on; isolation of the candidate; bundles and replay."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from shadowd.hook.config import HookConfig, Sampling, parse_mode, parse_sampling
from shadowd.hook.replay import format_report, replay_bundle
from shadowd.hook.site import Bucket, ShadowSite
from tests.hook.conftest import base_fn, cand_fn, inputs, make_runtime


def raising(*args: object) -> torch.Tensor:
    raise RuntimeError("candidate bug")


def nan_cand(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    out = cand_fn(x, w)
    out[0, 0] = float("nan")
    return out


def test_config_from_env() -> None:
    cfg = HookConfig.from_env({"KDTREE_VERIFY": "validate", "SHADOWD_SAMPLE": "1/8", "SHADOWD_SPOT_CHECK": "10"})
    assert cfg.mode == "validate" and cfg.sampling.every_n() == 8 and cfg.spot_every == 10
    assert HookConfig.from_env({"SHADOWD_MODE": "on", "KDTREE_VERIFY": "off"}).mode == "on"
    assert HookConfig.from_env({}).mode == "off"
    assert parse_sampling("0.25").every_n() == 4 and parse_sampling("all").every == 1
    with pytest.raises(ValueError):
        parse_mode("sometimes")
    assert parse_mode("0") == parse_mode("FALSE") == "off" and parse_mode(" Shadow ") == "validate"
    for vague in ("1", "true"):  # serving the candidate is asked for by name, never by a truthy flag
        with pytest.raises(ValueError, match="ambiguous: say 'validate'"):
            parse_mode(vague)


@pytest.mark.parametrize("key,value,says", [
    ("SHADOWD_SAMPLE", "abc", "SHADOWD_SAMPLE: sampling must be"),
    ("SHADOWD_SAMPLE", "1/2.5", "SHADOWD_SAMPLE: sampling must be"),
    ("SHADOWD_SAMPLE", "nan", "SHADOWD_SAMPLE: sampling fraction must be in"),
    ("SHADOWD_SPOT_CHECK", "0", "SHADOWD_SPOT_CHECK must be >= 1"),
    ("SHADOWD_SPOT_CHECK", "1/100", "SHADOWD_SPOT_CHECK must be a whole number"),
    ("SHADOWD_ORACLE", "-3", "SHADOWD_ORACLE must be >= 0"),
    ("SHADOWD_HARD_REL_L2", "nan", "SHADOWD_HARD_REL_L2 must be a finite number"),
    ("SHADOWD_HARD_SCALED_MAX_ABS", "-1", "SHADOWD_HARD_SCALED_MAX_ABS must be a finite number"),
    ("SHADOWD_DISABLE_AFTER", "x", "SHADOWD_DISABLE_AFTER must be a whole number"),
])
def test_bad_settings_are_refused_naming_the_variable(key: str, value: str, says: str) -> None:
    # (a NaN hard limit made every comparison false: on mode would never fall back; 0 spot checks became 1)
    with pytest.raises(ValueError, match=says.replace("(", r"\(")):
        HookConfig.from_env({"SHADOWD_MODE": "on", key: value})


@pytest.mark.parametrize("env,says", [
    ({"SHADOWD_MODE": "bogus"}, "SHADOWD_MODE: mode must be one of"),
    ({"KDTREE_VERIFY": "bogus"}, "KDTREE_VERIFY: mode must be one of"),
    ({"SHADOWD_MODE": "1"}, "SHADOWD_MODE: mode '1' is ambiguous"),
    ({"SHADOWD_URL": "localhost:8787"}, "SHADOWD_URL: 'localhost:8787': not an http:// or https:// URL"),
    ({"SHADOWD_URL": "ftp://collector"}, "SHADOWD_URL: 'ftp://collector': not an http:// or https:// URL"),
    ({"SHADOWD_URL": "http://[::1"}, "SHADOWD_URL: 'http://[::1': "),
    ({"SHADOWD_RANK": "-1", "RANK": "3"}, "SHADOWD_RANK must be >= 0"),
])
def test_bad_mode_and_url_are_refused_naming_the_variable(env: dict[str, str], says: str) -> None:
    with pytest.raises(ValueError, match=says.replace("(", r"\(").replace("[", r"\[")):
        HookConfig.from_env(env)


def test_the_rank_comes_from_shadowd_rank_before_rank() -> None:
    # (a launcher's RANK is not read when SHADOWD_RANK says it: an unusable RANK does not stop the hook)
    assert HookConfig.from_env({"SHADOWD_RANK": "1", "RANK": "abc"}).rank == 1
    assert HookConfig.from_env({"RANK": "2"}).rank == 2
    assert HookConfig.from_env({"SHADOWD_URL": "https://collector.internal:8787/"}).url == (
        "https://collector.internal:8787/")


def test_off_runs_only_the_baseline() -> None:
    rt, sink = make_runtime("off")
    calls = []
    site = ShadowSite("s", base_fn, lambda *a: calls.append(1), runtime=rt)
    x, w = inputs()
    assert torch.equal(site(x, w, layer=0), base_fn(x, w))
    assert not calls and not sink


def test_validate_returns_baseline_bit_for_bit_and_emits_stats() -> None:
    rt, sink = make_runtime("validate")
    site = ShadowSite("s", base_fn, cand_fn, runtime=rt)
    x, w = inputs()
    out = site(x, w, layer=0, bucket=Bucket(batch_size=2, draft_tokens=8, prefix_len=100, heads=4))
    ref = base_fn(x, w)
    assert out.dtype == ref.dtype and torch.equal(out.view(torch.int16), ref.view(torch.int16))
    (s,) = sink
    assert s["mode"] == "validate" and s["error"] is None and s["batch_size"] == 2 and s["heads"] == 4
    assert s["numel"] == out.numel() and s["max_abs"] > 0 and s["base_us"] >= 0 and s["cand_us"] >= 0
    assert sum(s["hist"]) == out.numel()


@pytest.mark.parametrize("cand,error", [(raising, "exception:RuntimeError"), (lambda x, w: base_fn(x, w)[:1], "shape"),
                                        (lambda x, w: base_fn(x, w).float(), "dtype"), (lambda x, w: None, "type")])
def test_validate_candidate_failures_become_samples(cand: object, error: str) -> None:
    rt, sink = make_runtime("validate", disable_after=3)
    site = ShadowSite("s", base_fn, cand, runtime=rt)  # type: ignore[arg-type]
    x, w = inputs()
    for i in range(5):
        assert torch.equal(site(x, w, layer=0), base_fn(x, w))
        if i < 3:
            assert sink[-1]["error"] == error and math.isnan(sink[-1]["max_abs"])
    assert len(sink) == 3, "disabled after 3 consecutive errors: no more shadow calls"
    assert rt.disabled and rt.producer_stats()["disabled"] == 1


def test_validate_nan_never_reaches_the_caller() -> None:
    rt, sink = make_runtime("validate")
    site = ShadowSite("s", base_fn, nan_cand, runtime=rt)
    x, w = inputs()
    out = site(x, w, layer=0)
    assert torch.isfinite(out.float()).all()
    assert sink[0]["cand_nonfinite"] == 1 and sink[0]["nan_cand"] == 1 and math.isnan(sink[0]["rel_l2"])
    assert rt.candidate_failures == 1 and not rt.disabled  # counted (the demo's progress line shows it)
    assert ShadowSite("s", base_fn, cand_fn, runtime=rt)(x, w, layer=0) is not None and rt.candidate_failures == 1


def test_candidate_cannot_modify_inputs() -> None:
    rt, sink = make_runtime("validate")

    def scribbler(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        x.mul_(2)  # small input: the candidate only sees a clone
        w.zero_()
        return cand_fn(x, w)

    site = ShadowSite("s", base_fn, scribbler, runtime=rt)
    x, w = inputs()
    x0, w0 = x.clone(), w.clone()
    site(x, w, layer=0)
    assert torch.equal(x, x0) and torch.equal(w, w0)
    # and it is found out: served in on mode, it would write into the caller's real inputs
    assert sink[0]["error"] == "input_modified" and rt.disabled


def test_large_shared_input_modification_is_detected_and_disables() -> None:
    rt, sink = make_runtime("validate")

    def scribbler(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        w.add_(0)  # an in-place write to a shared (too large to clone) tensor
        return cand_fn(x, w)

    site = ShadowSite("s", base_fn, scribbler, runtime=rt, clone_max_bytes=1024)
    x, w = inputs()
    site(x, w, layer=0)
    assert sink[0]["error"] == "input_modified" and rt.disabled


def clamping_candidate(bits: int, at_call: int = 2) -> tuple[Any, torch.Tensor, list[int]]:
    """A candidate that raises ``bits`` in its error word (as mla_tree_verify's kernels do when they clamp bad input)
    on its ``at_call``-th call: (candidate, the word, its calls)."""
    flag = torch.zeros(1, dtype=torch.int32)
    calls: list[int] = []

    def clamping(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        if len(calls) == at_call:
            flag.bitwise_or_(bits)
        return cand_fn(x, w)

    return clamping, flag, calls


def test_a_raised_candidate_error_flag_is_a_candidate_error_and_disables() -> None:
    # the candidate's own error word (mla_tree_verify's error_flag: bits its kernels raise when they clamp bad
    # input): the call that sees it becomes an error sample, the candidate is disabled with the bits named, and the
    # baseline's result is what returns, as for any candidate error
    rt, sink = make_runtime("validate")
    clamping, flag, calls = clamping_candidate(2)
    site = ShadowSite("s", base_fn, clamping, runtime=rt, candidate_flag=lambda device: flag,
                      describe_flag=lambda v: f"slot out of range ({v})")
    x, w = inputs()
    outs = [site(x, w, layer=0) for _ in range(4)]
    assert all(torch.equal(o, base_fn(x, w)) for o in outs)
    assert [s["error"] for s in sink] == [None, "candidate_flag:0x2"]
    assert rt.disabled and "slot out of range (2)" in rt.disabled_reason
    assert len(calls) == 2, "a disabled candidate never runs again"
    assert rt.producer_stats()["device_errors"] == 1, "reported to the collector with the producer's figures"


def test_on_mode_spot_check_that_sees_the_error_flag_serves_the_baseline() -> None:
    rt, sink = make_runtime("on", spot_every=1)
    flag = torch.zeros(1, dtype=torch.int32)

    def clamping(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        flag.fill_(1)
        return cand_fn(x, w)

    site = ShadowSite("s", base_fn, clamping, runtime=rt, candidate_flag=lambda device: flag)
    x, w = inputs()
    assert torch.equal(site(x, w, layer=0), base_fn(x, w))
    assert rt.fallback and rt.disabled and sink[0]["error"] == "candidate_flag:0x1"


def test_on_mode_between_spot_checks_a_raised_error_flag_is_never_served() -> None:
    # no spot check in sight: the word the candidate raises on an unchecked call is read right after it (CPU path),
    # that call serves the baseline, and the process falls back with the bits named
    rt, sink = make_runtime("on", spot_every=1000)
    clamping, flag, calls = clamping_candidate(4)
    site = ShadowSite("s", base_fn, clamping, runtime=rt, candidate_flag=lambda device: flag,
                      describe_flag=lambda v: f"bits {v}")
    x, w = inputs()
    outs = ["cand" if torch.equal(o, cand_fn(x, w)) else "base" for o in (site(x, w, layer=0) for _ in range(4))]
    assert outs == ["cand", "base", "base", "base"] and len(calls) == 2, (outs, len(calls))
    assert rt.fallback and rt.disabled and "bits 4" in rt.disabled_reason, (rt.fallback_reason, rt.disabled_reason)
    # (the one sample: the first call, checked as every call whose output shape the site has not yet seen)
    assert rt.producer_stats()["device_errors"] == 1 and [s["error"] for s in sink] == [None]


def test_a_failing_flag_description_falls_back_to_hex() -> None:
    rt, sink = make_runtime("validate")
    flag = torch.full((1,), 5, dtype=torch.int32)

    def broken(value: int) -> str:
        raise KeyError(value)

    site = ShadowSite("s", base_fn, cand_fn, runtime=rt, candidate_flag=lambda device: flag, describe_flag=broken)
    x, w = inputs()
    assert torch.equal(site(x, w, layer=0), base_fn(x, w))
    assert sink[0]["error"] == "candidate_flag:0x5" and rt.disabled_reason == "the candidate's error flag: 0x5"


def test_shared_argument_is_never_cloned_but_watched() -> None:
    seen: list[torch.Tensor] = []

    def reader(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        seen.extend([x, w])
        return cand_fn(x, w)

    def scribbler(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        w.add_(0)
        return cand_fn(x, w)

    x, w = inputs()
    rt, sink = make_runtime("validate")
    ShadowSite("s", base_fn, reader, runtime=rt, shared=(1,))(x, w, layer=0)
    assert seen[1] is w and seen[0] is not x  # w small, but shared by name: no copy per call; x cloned
    assert sink[0]["error"] is None
    rt, sink = make_runtime("validate")
    ShadowSite("s", base_fn, scribbler, runtime=rt, shared=(1,))(x, w, layer=0)
    assert sink[0]["error"] == "input_modified" and rt.disabled  # and still watched


def test_sampling_every_nth_step_all_layers_of_a_step() -> None:
    rt, sink = make_runtime("validate", sampling=Sampling(3))
    site = ShadowSite("s", base_fn, cand_fn, runtime=rt)
    x, w = inputs()
    for _step in range(9):
        for layer in range(2):
            site(x, w, layer=layer)
    assert sorted({s["step"] for s in sink}) == [3, 6, 9]
    assert len(sink) == 6


def test_on_mode_returns_candidate_and_spot_checks() -> None:
    rt, sink = make_runtime("on", spot_every=4)
    site = ShadowSite("s", base_fn, cand_fn, runtime=rt)
    x, w = inputs()
    outs = [site(x, w, layer=0) for _ in range(8)]
    assert all(torch.equal(o, cand_fn(x, w)) for o in outs)
    # step 1: the site had not seen the output's shape yet (a first call is always checked); then 1 in 4
    assert [s["step"] for s in sink] == [1, 4, 8] and all(s["mode"] == "on" for s in sink)
    assert not rt.fallback


@pytest.mark.parametrize("bad", ["nan", "exception", "large"])
def test_on_mode_hard_failure_falls_back_and_sticks(bad: str) -> None:
    rt, _sink = make_runtime("on", spot_every=2)
    state = {"n": 0}

    def flaky(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        state["n"] += 1
        if state["n"] >= 3:
            if bad == "exception":
                raise RuntimeError("boom")
            out = cand_fn(x, w)
            if bad == "nan":
                out[0, 0] = float("nan")
            else:
                out = out * 2
            return out
        return cand_fn(x, w)

    site = ShadowSite("s", base_fn, flaky, runtime=rt)
    x, w = inputs()
    results = [site(x, w, layer=0) for _ in range(10)]
    assert rt.fallback and rt.producer_stats()["fallback"] == 1
    first_bad = 2  # third call (step 3, not a spot check) is the first faulty one
    # a NaN or an exception is recognised without the baseline and never served, even between spot
    # checks; a finite wrong value ("large") needs the baseline, i.e. the next spot check (step 4)
    served_from = first_bad if bad in ("nan", "exception") else first_bad + 1
    for o in results[served_from:]:
        assert torch.equal(o, base_fn(x, w)), "after the fall-back every call is the baseline's"
    n_cand_calls = state["n"]
    site(x, w, layer=0)
    assert state["n"] == n_cand_calls, "the candidate never runs again"


def test_on_mode_uncovered_bucket_served_by_baseline() -> None:
    rt, sink = make_runtime("on", max_draft_tokens=64, max_prefix_len=131072)
    site = ShadowSite("s", base_fn, cand_fn, runtime=rt)
    x, w = inputs()
    out = site(x, w, layer=0, bucket=Bucket(draft_tokens=8, prefix_len=200_000))
    assert torch.equal(out, base_fn(x, w))
    assert sink and sink[-1]["mode"] == "validate", "shadowed to gather coverage"
    out = site(x, w, layer=0, bucket=Bucket(draft_tokens=8, prefix_len=4096))
    assert torch.equal(out, cand_fn(x, w))


def test_kill_switch_lowers_the_mode_on_the_next_call() -> None:
    rt, sink = make_runtime("on", spot_every=1000)
    site = ShadowSite("s", base_fn, cand_fn, runtime=rt)
    x, w = inputs()
    assert torch.equal(site(x, w, layer=0), cand_fn(x, w))
    rt.set_override("validate")
    assert torch.equal(site(x, w, layer=0), base_fn(x, w)) and sink[-1]["mode"] == "validate"
    rt.set_override("off")
    n = len(sink)
    assert torch.equal(site(x, w, layer=0), base_fn(x, w)) and len(sink) == n
    rt.set_override("on")  # an override never raises the mode above the configured one
    rt.set_override(None)
    assert rt.mode == "on"


def test_sink_failure_is_isolated() -> None:
    def broken_sink(sample: dict) -> None:
        raise OSError("disk full")

    rt, _ = make_runtime("validate")
    rt.sink = broken_sink
    site = ShadowSite("s", base_fn, cand_fn, runtime=rt)
    x, w = inputs()
    assert torch.equal(site(x, w, layer=0), base_fn(x, w))
    assert site.errors["sink"] == 1


def test_oracle_errors_recorded() -> None:
    rt, sink = make_runtime("validate", oracle_every=2, oracle_chunk_rows=3)
    site = ShadowSite("s", base_fn, cand_fn, oracle=lambda x, w: x.float() @ w.float(), runtime=rt)
    x, w = inputs()
    site(x, w, layer=0)
    site(x, w, layer=0)
    assert sink[0]["oracle_cand_err"] is None
    assert sink[1]["oracle_cand_err"] > 0 and sink[1]["oracle_base_err"] > 0


def base_into(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """A baseline that writes into the buffer it is given and returns it (as SGLang's attention does)."""
    out.copy_(base_fn(x, w))
    return out


@pytest.mark.parametrize("shared", [(), ("out",)])
def test_an_oracle_writing_into_its_arguments_never_changes_the_result(shared: tuple[str, ...]) -> None:
    # the oracle takes the same arguments as the baseline: one that writes its answer into ``out`` (and scribbles
    # on ``x``) must leave the caller's result and inputs as the baseline made them, whether ``out`` is small
    # enough to be copied or a shared buffer
    def oracle_into(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        out.copy_((x.float() @ w.float() + 1000).to(out.dtype))
        x.add_(100)
        return x.float() @ w.float()

    rt, sink = make_runtime("validate", oracle_every=1)
    site = ShadowSite("s", base_into, lambda x, w, out: cand_fn(x, w), oracle=oracle_into, runtime=rt,
                      shared=shared)
    x, w = inputs()
    x0 = x.clone()
    out = torch.zeros(x.shape[0], w.shape[1], dtype=torch.bfloat16)
    got = site(x, w, out=out, layer=0)
    assert torch.equal(got, base_fn(x0, w)) and torch.equal(x, x0)
    if not shared:  # the buffer was copied for the oracle: the caller's holds the baseline's result too
        assert torch.equal(out, base_fn(x0, w))
        assert sink[-1]["oracle_cand_err"] is not None and site.oracle_off is None
    else:  # a shared buffer is watched: the oracle wrote into it, so it is not called again
        assert site.oracle_off == "the oracle modified its inputs"
        calls = site.oracle_calls
        assert torch.equal(site(x0.clone(), w, out=torch.zeros_like(out), layer=0), base_fn(x0, w))
        assert site.oracle_calls == calls and sink[-1]["oracle_cand_err"] is None
        assert sink[-1]["error"] is None and not rt.disabled  # the candidate is not blamed


def test_a_baseline_returning_a_tuple_is_a_named_hook_fault_and_its_result_returns() -> None:
    def base_pair(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return base_fn(x, w), x.float().sum(1)

    rt, sink = make_runtime("validate")
    site = ShadowSite("s", base_pair, lambda x, w: (cand_fn(x, w), x.float().sum(1)), runtime=rt)
    x, w = inputs()
    out, lse = site(x, w, layer=0)
    assert torch.equal(out, base_fn(x, w)) and torch.equal(lse, x.float().sum(1))
    assert sink[-1]["error"] == "hook:TypeError" and rt.disabled
    assert "the baseline returned a tuple: a ShadowSite compares one output tensor" in (rt.disabled_reason or "")


def test_bundle_saved_bounded_and_replayed(tmp_path: Path) -> None:
    rt, _sink = make_runtime("validate", bundle_dir=tmp_path / "b", bundle_max=2)
    site = ShadowSite("toy", base_fn, nan_cand, runtime=rt,
                      refs={"baseline": "tests.hook.conftest:base_fn", "candidate": "tests.hook.test_site:nan_cand",
                            "oracle": ""})
    x, w = inputs()
    for _ in range(4):
        site(x, w, layer=0)
    bundles = sorted((tmp_path / "b").iterdir())
    assert len(bundles) == 2
    assert {p.name for p in bundles[0].iterdir()} == {"tensors.safetensors", "meta.json"}
    res = replay_bundle(bundles[0], oracle=lambda x, w: x.float() @ w.float())
    assert res["reason"] == "nonfinite" and res["saved"]["cand_nonfinite"] == 1
    assert res["rerun"]["cand_nonfinite"] == 1 and res["reproducible"] == {"baseline": 0.0, "candidate": 0.0}
    assert res["oracle"]["baseline_err"] > 0
    assert "candidate-only non-finite 1" in format_report(res)


def test_replay_of_a_bundle_without_refs_says_what_it_needs(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    from shadowd.cli import main

    rt, _sink = make_runtime("validate", bundle_dir=tmp_path / "b", bundle_max=1)
    site = ShadowSite("toy", base_fn, nan_cand, runtime=rt)  # no refs: the bundle cannot name its callables
    x, w = inputs()
    site(x, w, layer=0)
    (bundle,) = (tmp_path / "b").iterdir()
    assert main(["replay", str(bundle)]) == 1
    out = capsys.readouterr().out
    assert "not run: no baseline and no candidate to call" in out and "--baseline / --candidate" in out
    assert main(["replay", str(bundle), "--baseline", "tests.hook.conftest:base_fn",
                 "--candidate", "tests.hook.test_site:nan_cand"]) == 0
    assert "rerun  candidate vs baseline: max_abs" in capsys.readouterr().out
    assert main(["replay", str(bundle), "--candidate", "no_such_module:f"]) == 64
    assert main(["replay", str(tmp_path)]) == 64
    assert "not a repro bundle" in capsys.readouterr().err


def test_a_fault_of_the_hook_itself_serves_the_baseline_and_is_reported() -> None:
    """What the hook's own code raises after the baseline (here: copying the candidate's inputs) never reaches
    the caller: the baseline's result is returned, the candidate disabled with the reason, and one sample says
    ``hook:<type>``; later calls are the baseline alone."""
    rt, samples = make_runtime("validate")
    site = ShadowSite("t", base_fn, cand_fn, runtime=rt)

    def broken(*a: Any, **k: Any) -> Any:
        raise MemoryError("no room for the copies")

    site._protect = broken  # type: ignore[method-assign]
    x, w = inputs()
    assert torch.equal(site(x, w, layer=0), base_fn(x, w))
    assert rt.disabled and "MemoryError" in (rt.disabled_reason or "")
    assert [s["error"] for s in samples] == ["hook:MemoryError"]
    assert torch.equal(site(x, w, layer=0), base_fn(x, w)) and len(samples) == 1


def test_what_the_baseline_raises_reaches_the_caller_unchanged() -> None:
    rt, samples = make_runtime("validate")

    def bad_base(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        raise ValueError("baseline says no")

    with pytest.raises(ValueError, match="baseline says no"):
        ShadowSite("t", bad_base, cand_fn, runtime=rt)(*inputs(), layer=0)
    assert not rt.disabled and samples == []
