"""The shadowd SGLang plugin against the real sglang 0.5.23 (CPU, Triton interpreter, fp32)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.sglang.builders import make_case, run_layers

VERIFY = "sglang.srt.layers.attention.triton_backend.TritonAttnBackend.forward_extend"


def _runtime(mode: str, **cfg: Any) -> list[dict[str, Any]]:
    from shadowd.hook.config import HookConfig
    from shadowd.hook.runtime import HookRuntime, set_runtime

    samples: list[dict[str, Any]] = []
    set_runtime(HookRuntime(HookConfig(mode=mode, **cfg), sink=samples.append))
    return samples


def _load(plugins: Any, monkeypatch: pytest.MonkeyPatch, mode: str | None) -> None:
    if mode is not None:
        monkeypatch.setenv("SHADOWD_MODE", mode)
    plugins.load_plugins()


def test_off_registers_nothing(sgl: Any, fresh_plugins: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry

    import shadowd.sglang.plugin as plugin

    original = sgl.TritonAttnBackend.__dict__["forward_extend"]
    _load(fresh_plugins, monkeypatch, None)
    assert plugin.state().mode == "off"
    assert plugin.state().registered == []
    assert dict(HookRegistry._hooks) == {}
    assert sgl.TritonAttnBackend.__dict__["forward_extend"] is original


def test_kdtree_verify_off_spelling(sgl: Any, fresh_plugins: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import shadowd.sglang.plugin as plugin

    monkeypatch.setenv("KDTREE_VERIFY", "off")
    _load(fresh_plugins, monkeypatch, None)
    assert plugin.state().registered == []


def test_discovered_by_load_plugins_and_wraps_forward_extend(sgl: Any, fresh_plugins: Any,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    import shadowd.sglang.plugin as plugin

    original = sgl.TritonAttnBackend.__dict__["forward_extend"]
    _load(fresh_plugins, monkeypatch, "validate")
    assert plugin.state().mode == "validate"
    assert VERIFY in plugin.state().registered
    assert [ht for ht, _, _ in HookRegistry._hooks[VERIFY]] == [HookType.AROUND]
    src = HookRegistry._hooks[VERIFY][0][2]
    assert src is not None and src.plugin_name == "shadowd"  # registered from inside load_plugins()
    wrapped = sgl.TritonAttnBackend.__dict__["forward_extend"]
    assert wrapped is not original and wrapped.__wrapped__ is original
    fresh_plugins.load_plugins()  # idempotent
    assert len(HookRegistry._hooks[VERIFY]) == 1


@pytest.mark.parametrize("causal", [False, True], ids=["tree-mask", "causal"])
def test_validate_returns_triton_exactly_one_sample_per_layer(sgl: Any, fresh_plugins: Any,
                                                              monkeypatch: pytest.MonkeyPatch, causal: bool) -> None:
    ref_case = make_case(sgl, causal=causal)
    expected = run_layers(ref_case)  # the un-hooked SGLang
    samples = _runtime("validate")
    _load(fresh_plugins, monkeypatch, "validate")
    case = make_case(sgl, causal=causal)
    got = run_layers(case)
    for e, o in zip(expected, got, strict=True):
        assert o.shape == e.shape == (8, 2 * 512) and o.dtype == torch.float32
        assert torch.equal(o, e)
    for i in range(len(case.layers)):  # the cache SGLang wrote, bit for bit
        assert torch.equal(case.pool.get_key_buffer(i), ref_case.pool.get_key_buffer(i))
    assert [s["layer"] for s in samples] == [0, 1, 2]
    for s in samples:
        assert s["mode"] == "validate" and s["error"] is None
        assert (s["batch_size"], s["draft_tokens"], s["prefix_len"], s["heads"]) == (2, 4, 13, 2)
        assert s["rank"] == 0 and s["step"] == 1
        assert s["cand_nonfinite"] == 0 and s["base_nonfinite"] == 0
        assert s["max_abs"] < 1e-4  # candidate here: the fp32 oracle; baseline: Triton fp32
    assert {s["new_requests"] for s in samples[1:]} == {None}


def test_each_step_buckets_its_own_shape_on_the_same_backend_and_layers(sgl: Any, fresh_plugins: Any,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A step's bucket is made by its first layer's call and reused by the others; the next step (new forward
    metadata, as SGLang makes every step, here even in the same ForwardBatch object) gets its own."""
    samples = _runtime("validate")
    _load(fresh_plugins, monkeypatch, "validate")
    case = make_case(sgl)
    run_layers(case)
    nxt = make_case(sgl, prefix=(30, 9), seed=1)
    case.backend.forward_metadata = nxt.backend.forward_metadata
    case.backend.token_to_kv_pool = nxt.pool
    case.forward_batch.seq_lens_cpu = nxt.forward_batch.seq_lens_cpu
    case.forward_batch.out_cache_loc = nxt.forward_batch.out_cache_loc
    case.q, case.k = nxt.q, nxt.k
    run_layers(case)
    got = [(s["step"], s["layer"], s["prefix_len"]) for s in samples]
    assert got == [(1, 0, 13), (1, 1, 13), (1, 2, 13), (2, 0, 30), (2, 1, 30), (2, 2, 30)], got
    assert all(s["error"] is None and s["max_abs"] < 1e-4 for s in samples), samples


def test_validate_oracle_sampling_records_both_sides_errors(sgl: Any, fresh_plugins: Any,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    expected = run_layers(make_case(sgl))
    samples = _runtime("validate", oracle_every=2)
    _load(fresh_plugins, monkeypatch, "validate")
    got = run_layers(make_case(sgl))
    assert all(torch.equal(e, o) for e, o in zip(expected, got, strict=True))  # still Triton's result
    assert [s["oracle_cand_err"] is None for s in samples] == [True, False, True]
    s = samples[1]
    # the CPU stand-in candidate is this oracle (bit for bit); SGLang's Triton is near it, not equal
    assert s["oracle_cand_err"] == 0.0
    assert 0.0 < s["oracle_base_err"] < 1e-4


def biased_candidate(q: torch.Tensor, k: torch.Tensor, kv_buffer: torch.Tensor, qo_indptr: torch.Tensor,
                     kv_indptr: torch.Tensor, kv_indices: torch.Tensor, custom_mask: Any, mask_indptr: Any,
                     sm_scale: float, max_q_len: int | None = None) -> torch.Tensor:
    """A faulty candidate (``SHADOWD_CANDIDATE``): the fp32 oracle plus 0.5 everywhere."""
    from mla_tree_verify import oracle

    return oracle.attention(q, k, kv_buffer, qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr, sm_scale,
                            dtype=torch.float32) + 0.5


def test_validate_bundle_holds_only_what_the_call_reads_and_replays(sgl: Any, fresh_plugins: Any,
                                                                    monkeypatch: pytest.MonkeyPatch,
                                                                    tmp_path: Any) -> None:
    import json

    from safetensors.torch import load_file

    from shadowd.hook.replay import replay_bundle
    from shadowd.sglang.bundles import REFS

    expected = run_layers(make_case(sgl))  # the un-hooked SGLang
    monkeypatch.setenv("SHADOWD_CANDIDATE", "tests.sglang.test_plugin:biased_candidate")
    samples = _runtime("validate", bundle_dir=tmp_path / "b", bundle_max=1)
    _load(fresh_plugins, monkeypatch, "validate")
    case = make_case(sgl)
    assert all(torch.equal(e, o) for e, o in zip(expected, run_layers(case), strict=True))
    assert len(samples) == 3 and all(s["rel_l2"] > 0.1 for s in samples)
    (bundle,) = sorted((tmp_path / "b").iterdir())  # one: the count bound
    meta = json.loads((bundle / "meta.json").read_text())
    assert meta["refs"] == REFS and meta["kwargs"] == {"sm_scale": 192**-0.5, "max_q_len": 4}
    assert "unserializable" not in json.dumps(meta["args"])  # no SGLang object: a self-contained call
    t = load_file(str(bundle / "tensors.safetensors"))
    md = case.backend.forward_metadata
    n = md.kv_indices.numel()
    assert t["arg.0"].shape == (8, 2, 576) and t["arg.2"].shape == (n, 1, 576)  # the rows read, not the cache
    assert torch.equal(t["arg.2"].reshape(n, 576), case.pool.get_key_buffer(0)[md.kv_indices].reshape(n, 576))
    assert torch.equal(t["arg.5"], torch.arange(n))
    assert torch.equal(t["out.baseline"], expected[0])
    res = replay_bundle(bundle, device="cpu")
    assert res["errors"] == {}, res["errors"]
    assert res["reproducible"] == {"baseline": 0.0, "candidate": 0.0}, res["reproducible"]
    assert res["oracle"]["candidate_err"] == pytest.approx(0.5, abs=1e-6)
    assert res["oracle"]["baseline_err"] < 1e-4


def test_non_verify_modes_and_draft_runner_untouched(sgl: Any, fresh_plugins: Any,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import shadowd.sglang.plugin as plugin

    samples = _runtime("validate")
    _load(fresh_plugins, monkeypatch, "validate")
    original = sgl.TritonAttnBackend.__dict__["forward_extend"].__wrapped__
    for kw in ({"mode": "EXTEND"}, {"mode": "DRAFT_EXTEND_V2"}, {"draft_runner": True}):
        expected = run_layers(make_case(sgl, **kw), forward_extend=original)
        got = run_layers(make_case(sgl, **kw))
        assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True)), kw
    assert samples == []
    v = plugin.state().verify
    assert v.shadowed == 0 and v.passed == 9
    assert set(v.reasons) == {"not target verify", "draft runner"}


def test_on_mode_serves_candidate_and_writes_cache_as_sglang(sgl: Any, fresh_plugins: Any,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from mla_tree_verify import oracle

    ref_case = make_case(sgl)
    expected = run_layers(ref_case)
    samples = _runtime("on", spot_every=1000)
    _load(fresh_plugins, monkeypatch, "on")
    case = make_case(sgl)
    got = run_layers(case)
    md = case.backend.forward_metadata
    for i, (e, o) in enumerate(zip(expected, got, strict=True)):
        assert torch.equal(case.pool.get_key_buffer(i), ref_case.pool.get_key_buffer(i))
        cand = oracle.attention(case.q[i].view(8, 2, 576), case.k[i], case.pool.get_key_buffer(i), md.qo_indptr,
                                md.kv_indptr, md.kv_indices, md.custom_mask, md.mask_indptr, 192**-0.5,
                                dtype=torch.float32)
        assert torch.equal(o, cand.view(8, 1024))  # the candidate's result, SGLang's layout
        assert (o - e).abs().max() < 1e-4
    # step 1 is no spot-check step (1 in 1000); only the site's first call is checked (the first time it sees the
    # output's shape: the later layers' outputs have the same one)
    assert [(s["layer"], s["error"]) for s in samples] == [(0, None)]


def test_on_mode_fills_sglang_output_buffer(sgl: Any, fresh_plugins: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    _runtime("on", spot_every=1000)
    _load(fresh_plugins, monkeypatch, "on")
    case = make_case(sgl, layers=1)
    buf = torch.full((8, 1024), float("nan"))
    case.forward_batch._attn_output = buf
    (out,) = run_layers(case)
    assert out.data_ptr() != buf.data_ptr()  # run_layers clones; the buffer itself was filled:
    assert torch.isfinite(buf).all() and torch.equal(out, buf)


def test_kill_switch_off_at_runtime_is_plain_sglang(sgl: Any, fresh_plugins: Any,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from shadowd.hook.runtime import get_runtime

    expected = run_layers(make_case(sgl))
    samples = _runtime("on")
    _load(fresh_plugins, monkeypatch, "on")
    get_runtime().set_override("off")
    got = run_layers(make_case(sgl))
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    assert samples == []


def test_spec_accept_length_per_mode(sgl: Any, fresh_plugins: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from sglang.srt.managers.scheduler_components.metrics_reporter import SchedulerMetricsReporter

    import shadowd.sglang.plugin as plugin
    from shadowd.hook.runtime import get_runtime

    _runtime("validate")
    _load(fresh_plugins, monkeypatch, "validate")
    rep = SimpleNamespace(spec_num_accept_tokens=0, spec_num_correct_drafts=0, spec_num_forward_ct=0,
                          spec_num_block_accept_tokens=0, spec_num_cap_tokens=0)
    SchedulerMetricsReporter.update_spec_metrics(rep, 4, 6, 10)  # the real method, through the hook
    get_runtime().set_override("off")
    SchedulerMetricsReporter.update_spec_metrics(rep, 2, 1, 3)
    assert rep.spec_num_accept_tokens == 13 and rep.spec_num_forward_ct == 6  # SGLang's own counters intact
    spec = plugin.state().spec
    assert spec.summary("validate") == (2.5, 10.0)
    assert spec.summary("off") == (1.5, 3.0)
    assert spec.producer_stats(("spec_passes_off",)) == {"spec_passes_off": 1}
    from shadowd.wire import PRODUCER_STATS

    sent = spec.producer_stats(PRODUCER_STATS)  # what rides in every wire batch to the collector
    assert sent["spec_accept_tokens_validate"] == 10 and sent["spec_req_steps_off"] == 2 and len(sent) == 9


def test_site_reads_the_kernels_error_flag() -> None:
    """The verify site hands the hook the candidate's device error word (``tree_verify``'s ``error_flag``) and names
    its bits in words; on CPU there is none (the fp32 stand-in raises nothing)."""
    from types import SimpleNamespace

    from shadowd.hook.config import HookConfig
    from shadowd.hook.runtime import HookRuntime
    from shadowd.sglang.candidate import describe_flag, error_flag
    from shadowd.sglang.verify import VerifyShadow

    site = VerifyShadow(runtime=HookRuntime(HookConfig(mode="validate")), first_layer=0)._site(SimpleNamespace())
    assert site.candidate_flag is error_flag and site.describe_flag is describe_flag
    assert error_flag(torch.device("cpu")) is None
    assert "kv_indices entry outside" in describe_flag(1) and "max_q_len" in describe_flag(2)
    assert describe_flag(0) == "0x0"


def test_a_custom_candidate_without_an_error_flag_parameter_is_not_given_one() -> None:
    """``SHADOWD_CANDIDATE`` functions written before a word existed keep working: each word is passed only to a
    function that takes it (``tree_verify`` takes both)."""
    import mla_tree_verify

    from shadowd.sglang.candidate import _takes

    for word in ("error_flag", "nonfinite_flag"):
        assert _takes(mla_tree_verify.tree_verify, word)
        assert _takes(lambda *a, **kw: None, word)

    def older(q: Any, k: Any, kv: Any, qo: Any, kvp: Any, kvi: Any, m: Any, mi: Any, s: Any,
              max_q_len: Any = None, error_flag: Any = None) -> Any:
        return q

    assert _takes(older, "error_flag") and not _takes(older, "nonfinite_flag")


def _through_the_hook(sgl: Any, fresh_plugins: Any, monkeypatch: pytest.MonkeyPatch, case: Any,
                      stand_in: Any = None) -> tuple[Any, list[Any], list[tuple[Any, ...]]]:
    """Every layer of ``case`` through the validate plugin's hook around SGLang's own forward_extend (or
    ``stand_in``): (the hook, the samples emitted, the arguments of each call that reached the original)."""
    from sglang.srt.runtime_context import get_parallel

    import shadowd.sglang.plugin as plugin

    samples = _runtime("validate")
    _load(fresh_plugins, monkeypatch, "validate")
    original = stand_in or sgl.TritonAttnBackend.__dict__["forward_extend"].__wrapped__
    calls: list[tuple[Any, ...]] = []

    def recording(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return original(*args, **kwargs)

    v = plugin.state().verify
    with get_parallel().override(dcp_enabled=False):
        for layer, q, k in zip(case.layers, case.q, case.k, strict=True):
            v(recording, case.backend, q, k, k[..., :512], layer, case.forward_batch)
    return v, samples, calls


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.float8_e4m3fn], ids=["fp16-cache", "fp8-cache"])
def test_a_cache_in_another_dtype_than_q_is_passed_through(sgl: Any, fresh_plugins: Any,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           cache_dtype: torch.dtype) -> None:
    """``--kv-cache-dtype fp8_e4m3`` without KV scales (``layer.k_scale`` None): SGLang's Triton kernel reads the fp8
    cache and rounds q to fp8 for the dot; the candidate takes a cache in q's dtype only (``tree_verify``: bf16, an
    ArgumentError on anything else, which disabled the candidate for the process and made the run NOT_READY for good).
    Such a call is no like-for-like comparison: it is SGLang's, untouched, and the reason counted."""
    fp8 = cache_dtype == torch.float8_e4m3fn
    v, samples, calls = _through_the_hook(
        sgl, fresh_plugins, monkeypatch, make_case(sgl, layers=2, cache_dtype=cache_dtype),
        (lambda *args, **kwargs: args[1][:, :1024] * 0) if fp8 else None)
    original = sgl.TritonAttnBackend.__dict__["forward_extend"].__wrapped__
    assert samples == []
    assert v.shadowed == 0 and v.reasons == {"KV cache dtype differs from q": 2}, v.reasons
    # SGLang's own call, with the cache write left to it (save_kv_cache=True)
    assert len(calls) == 2 and all(c[6] is True for c in calls)
    if cache_dtype == torch.float16:  # (the Triton interpreter takes fp16, not fp8): the same result as plain SGLang
        ref = make_case(sgl, layers=2, cache_dtype=cache_dtype)
        expected = run_layers(ref, forward_extend=original)
        got = run_layers(make_case(sgl, layers=2, cache_dtype=cache_dtype))
        assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))


def test_the_candidates_known_q_dtypes() -> None:
    """``tree_verify`` (the default candidate on CUDA) takes bf16 only; a ``SHADOWD_CANDIDATE`` of the user's, and
    the CPU stand-in, declare nothing (their refusals become samples)."""
    from shadowd.sglang.candidate import CANDIDATE_ENV, candidate_q_dtypes

    assert candidate_q_dtypes(True, {}) == (torch.bfloat16,)
    assert candidate_q_dtypes(False, {CANDIDATE_ENV: "mla_tree_verify:tree_verify"}) == (torch.bfloat16,)
    assert candidate_q_dtypes(True, {CANDIDATE_ENV: "my_kernels:verify"}) is None
    assert candidate_q_dtypes(False, {}) is None


def test_a_q_in_a_dtype_the_candidate_does_not_take_is_passed_through(sgl: Any, fresh_plugins: Any,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A model served in fp16 or fp32 with ``tree_verify`` as candidate: every shadowed call would raise its
    ArgumentError (q must be bf16), the candidate would be disabled after a few and the run judged NOT_READY for a
    kernel that was never compared. Such calls are SGLang's, untouched, and the reason is counted (and said)."""
    monkeypatch.setenv("SHADOWD_CANDIDATE", "mla_tree_verify:tree_verify")
    # (float32 q and cache: the Triton interpreter's dtype)
    v, samples, calls = _through_the_hook(sgl, fresh_plugins, monkeypatch, make_case(sgl, layers=2))
    assert samples == []
    assert v.shadowed == 0 and list(v.reasons.values()) == [2], v.reasons
    (why,) = v.reasons
    assert "torch.float32" in why and "torch.bfloat16" in why
    assert len(calls) == 2 and all(c[6] is True for c in calls)  # SGLang's own call, cache write included


def test_target_verify_calls_not_shadowed_say_why_once(sgl: Any, fresh_plugins: Any, monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """A deployment whose target-verify calls all pass through (KV scales, an fp8 cache, a sliding window, ...) said
    'plugin active' and then streamed nothing, with no word why (the reasons were only counted in memory). The
    first call of each such reason is logged; prefill, decode, the draft runner and mode off (the common pass-through)
    are not."""
    import logging

    samples = _runtime("validate")
    _load(fresh_plugins, monkeypatch, "validate")
    with caplog.at_level(logging.INFO, logger="shadowd.sglang"):
        run_layers(make_case(sgl, mode="EXTEND"))
        run_layers(make_case(sgl, draft_runner=True))
        assert [r for r in caplog.records if "not shadowed" in r.getMessage()] == []
        for _ in range(2):
            run_layers(make_case(sgl, cache_dtype=torch.float16))
    said = [r for r in caplog.records if "not shadowed" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING, [r.getMessage() for r in said]
    assert "KV cache dtype differs from q" in said[0].getMessage() and "layer 0" in said[0].getMessage()
    assert samples == []


def test_spec_on_counts_only_steps_that_serve_the_candidate(sgl: Any, fresh_plugins: Any,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """On mode after a fallback (or with the candidate disabled) serves SGLang's kernel: those steps' accept length
    is the baseline's, and was counted as 'on' — diluting the on-mode figure exactly when the candidate misbehaved."""
    from types import SimpleNamespace

    from sglang.srt.managers.scheduler_components.metrics_reporter import SchedulerMetricsReporter

    import shadowd.sglang.plugin as plugin
    from shadowd.hook.runtime import get_runtime

    _runtime("on")
    _load(fresh_plugins, monkeypatch, "on")
    rep = SimpleNamespace(spec_num_accept_tokens=0, spec_num_correct_drafts=0, spec_num_forward_ct=0,
                          spec_num_block_accept_tokens=0, spec_num_cap_tokens=0)
    SchedulerMetricsReporter.update_spec_metrics(rep, 4, 6, num_accept_tokens=10)  # (SGLang passes it by keyword)
    case = make_case(sgl, layers=1)
    get_runtime().fall_back("test")
    expected = run_layers(make_case(sgl, layers=1), forward_extend=sgl.TritonAttnBackend.__dict__[
        "forward_extend"].__wrapped__)
    assert torch.equal(run_layers(case)[0], expected[0])  # what is served now: SGLang's kernel
    SchedulerMetricsReporter.update_spec_metrics(rep, 2, 1, num_accept_tokens=3)
    spec = plugin.state().spec
    assert spec.summary("on") == (2.5, 10.0)
    assert spec.counts["spec_passes_on"] == 1 and spec.counts["spec_passes_validate"] == 1
    assert spec.summary("validate") == (1.5, 3.0)


@pytest.mark.parametrize("broken", ["warm_graph_shape", "_write_kv"])
@pytest.mark.parametrize("mode", ["validate", "on"])
def test_a_fault_in_the_hooks_own_shape_code_serves_sglang_and_disables_the_candidate(
        sgl: Any, fresh_plugins: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        mode: str, broken: str) -> None:
    """The wrapper writes the draft K/V (through SGLang's internals) and builds the call's shape bucket (on CUDA, a
    Triton kernel) before its site takes the call: a failure there used to raise into SGLang's forward. SGLang now
    serves the call, its KV cache written as without the hook (by SGLang itself when the wrapper's write failed);
    the candidate is disabled for the process with the reason; the traceback is logged once."""
    import logging

    import shadowd.sglang.verify as verify
    from shadowd.hook.runtime import get_runtime

    ref_case = make_case(sgl)
    expected = run_layers(ref_case)
    samples = _runtime(mode)
    _load(fresh_plugins, monkeypatch, mode)

    def fails(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("shape kernel failed to compile")

    monkeypatch.setattr(verify.VerifyShadow if broken == "_write_kv" else verify, broken, fails)
    case = make_case(sgl)
    with caplog.at_level(logging.ERROR, logger="shadowd"):
        got = run_layers(case)
        again = run_layers(make_case(sgl))
    for e, o, o2 in zip(expected, got, again, strict=True):
        assert torch.equal(o, e) and torch.equal(o2, e), "SGLang's own result"
    for i in range(len(case.layers)):
        assert torch.equal(case.pool.get_key_buffer(i), ref_case.pool.get_key_buffer(i))
    rt = get_runtime()
    assert rt.disabled and "hook error: RuntimeError: shape kernel failed to compile" in (rt.disabled_reason or "")
    assert [r.getMessage() for r in caplog.records].count(
        "shadowd: the verify hook failed before its site; SGLang serves the call") == 1
    assert samples == []
