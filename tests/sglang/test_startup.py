"""Startup checks: the tested SGLang range, CUDA-graph safety, the run key and the run's fields."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from shadowd.hook.config import HookConfig
from shadowd.sglang.compat import UntestedSGLang, check_version
from shadowd.sglang.graphs import GraphUnsafe, check_graph_safety, graph_refusal
from shadowd.sglang.process import derive_run_key, run_fields


def test_version_range() -> None:
    assert check_version("0.5.23", env={}) == "0.5.23"
    assert check_version("0.5.23.post1", env={}) == "0.5.23.post1"
    assert check_version("0.5.23+cu128", env={}) == "0.5.23+cu128"
    # a pre-release of 0.5.23 precedes it: outside >=0.5.23 (it was read as 0.5.23 and accepted)
    for bad in ("0.5.22", "0.5.24", "0.6.0", "garbage", "0.5.23rc0", "0.5.23.dev3", "0.5.24rc1"):
        with pytest.raises(UntestedSGLang, match="SHADOWD_SGLANG_ALLOW_UNTESTED"):
            check_version(bad, env={})
    assert check_version("0.6.0", env={"SHADOWD_SGLANG_ALLOW_UNTESTED": "1"}) == "0.6.0"


def test_untested_sglang_refuses_backend_start(sgl: Any, fresh_plugins: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import shadowd.sglang.compat as compat
    import shadowd.sglang.plugin as plugin

    monkeypatch.setattr(compat, "installed_version", lambda: "0.5.99")
    monkeypatch.setenv("SHADOWD_MODE", "validate")
    fresh_plugins.load_plugins()
    assert plugin.state().refusal and "0.5.99" in plugin.state().refusal
    assert plugin.BACKEND_INIT in plugin.state().registered and len(plugin.state().registered) == 1
    with pytest.raises(RuntimeError, match="outside the tested range"):
        sgl.TritonAttnBackend(SimpleNamespace(is_draft_worker=False))


def test_a_bad_setting_refuses_backend_start_naming_it(sgl: Any, fresh_plugins: Any,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import shadowd.sglang.plugin as plugin

    monkeypatch.setenv("SHADOWD_MODE", "on")
    monkeypatch.setenv("SHADOWD_HARD_REL_L2", "nan")  # NaN limits: no comparison would ever fall back
    fresh_plugins.load_plugins()
    assert plugin.state().refusal and "SHADOWD_HARD_REL_L2" in plugin.state().refusal
    with pytest.raises(RuntimeError, match="SHADOWD_HARD_REL_L2 must be a finite number"):
        sgl.TritonAttnBackend(SimpleNamespace(is_draft_worker=False))


def test_installed_sglang_is_tested(sgl: Any) -> None:
    assert check_version(env={}).startswith("0.5.23")


def test_graph_refusal_names_the_flag() -> None:
    ok = HookConfig(mode="validate")
    assert graph_refusal(ok, {}, device_path_ok=True) is None
    check_graph_safety(ok, True, {}, device_path_ok=True)
    check_graph_safety(HookConfig(mode="validate", oracle_every=10), False, {})  # graphs off: anything goes
    assert graph_refusal(HookConfig(mode="off"), {}, device_path_ok=False) is None
    bad = [(HookConfig(mode="validate"), {}, False), (HookConfig(mode="on", oracle_every=4), {}, True),
           (HookConfig(mode="validate"), {"SHADOWD_CANDIDATE": "mla_tree_verify.oracle:attention"}, True)]
    for cfg, env, dev in bad:
        with pytest.raises(GraphUnsafe, match=r"--cuda-graph-backend-decode=disabled.*--disable-cuda-graph"):
            check_graph_safety(cfg, True, env, device_path_ok=dev)


def test_run_key() -> None:
    assert derive_run_key({"SHADOWD_RUN_KEY": "k8s-job-17"}) == "k8s-job-17"
    assert "systemd-abc" in derive_run_key({"INVOCATION_ID": "abc"})
    a, b = derive_run_key({}), derive_run_key({})
    assert a == b  # deterministic within a launch (same parent process)


def test_run_fields() -> None:
    f = run_fields("key", 61, 8, "0.5.23", "moonshotai/Kimi-K2")
    assert (f["num_layers"], f["tp_size"], f["sglang_version"]) == (61, 8, "0.5.23")
    assert f["candidate"]["name"] == "mla_tree_verify" and f["candidate"]["fingerprint"]
    assert f["baseline"]["fingerprint"].startswith("sglang-0.5.23-triton-")
    from shadowd.collector.schemas import RunCreate

    RunCreate.model_validate(f)  # what the collector accepts


def test_the_candidate_fingerprint_is_the_library_that_will_be_loaded(tmp_path: Any) -> None:
    # a prebuilt MLA_TREE_VERIFY_LIB was fingerprinted by the sources beside it: a rebuilt library kept the
    # fingerprint of the build the gate had passed
    from shadowd.sglang.candidate import candidate_fingerprint

    lib = tmp_path / "libmla_tree_verify.so"
    lib.write_bytes(b"build one")
    one = candidate_fingerprint({"MLA_TREE_VERIFY_LIB": str(lib)})
    lib.write_bytes(b"build two")
    two = candidate_fingerprint({"MLA_TREE_VERIFY_LIB": str(lib)})
    assert one.startswith("mla_tree_verify-lib-") and one != two
    assert candidate_fingerprint({}).startswith("mla_tree_verify-src-")


def test_version_range_without_packaging(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "packaging.version", None)  # (import fails: the fallback's ordering)
    for good in ("0.5.23", "0.5.23.post1", "0.5.23+cu128"):
        assert check_version(good, env={}) == good
    for bad in ("0.5.22", "0.5.24", "garbage", "0.5.23rc0", "0.5.23.dev3", "0.5.24rc1"):
        with pytest.raises(UntestedSGLang):
            check_version(bad, env={})
