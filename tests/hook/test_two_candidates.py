"""Two candidates shadowed in one process, each in a run of its own (``HookRuntime.from_env(run_key=...)``).

Samples carry no site name, so what keeps two candidates' statistics, verdicts and kill switches apart is the
runtime: each one registers its own run. These tests drive both against a real collector.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
import torch

from shadowd.client import CollectorClient
from shadowd.hook.runtime import HookRuntime
from shadowd.hook.site import ShadowSite
from tests.hook.conftest import Collector, base_fn, cand_fn, inputs, run_body, wait_for


def env_for(collector: Collector, tmp_path: Path) -> dict[str, str]:
    """The one environment both candidates' runtimes read (as an inference server's process has one)."""
    return {"SHADOWD_MODE": "validate", "SHADOWD_URL": collector.url, "SHADOWD_RUN_KEY": "attn-run",
            "SHADOWD_SPOOL_DIR": str(tmp_path / "spool")}


def scribbler(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    w.add_(0)  # an in-place write into an input it shares with the baseline: disabled at once
    return cand_fn(x, w)


def test_each_candidate_has_its_own_run_state_and_kill_switch(collector: Collector, tmp_path: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    env = env_for(collector, tmp_path)
    attn_rt = HookRuntime.from_env(env=env)
    mlp_rt = HookRuntime.from_env("mlp-run", env=env)
    assert (attn_rt.config.run_key, mlp_rt.config.run_key) == ("attn-run", "mlp-run")
    assert mlp_rt.config.url == collector.url and mlp_rt.mode == "validate", "the rest is the environment's"
    meta = {k: v for k, v in run_body("x").items() if k != "run_key"}
    attn_st = attn_rt.start_streaming(dict(meta, candidate={"name": "attn-cand", "fingerprint": "a1"}))
    mlp_st = mlp_rt.start_streaming(dict(meta, candidate={"name": "mlp-cand", "fingerprint": "m1"}))
    for st in (attn_st, mlp_st):
        st.flush_interval_s = 0.05
        st.poll_interval_s = 0.2
    assert attn_rt.run_id != mlp_rt.run_id
    with caplog.at_level("WARNING", logger="shadowd.hook"):
        attn = ShadowSite("attn", base_fn, cand_fn, runtime=attn_rt)
        mlp = ShadowSite("mlp", base_fn, scribbler, runtime=mlp_rt, clone_max_bytes=1024)
    assert not [r for r in caplog.records if "share one runtime" in r.getMessage()], "one site name per runtime"

    x, w = inputs()
    for _step in range(3):
        for layer in range(4):
            assert torch.equal(attn(x, w, layer=layer), base_fn(x, w))
            assert torch.equal(mlp(x, w, layer=layer), base_fn(x, w))
    # the MLP candidate's failure is its own: the attention candidate goes on being compared
    assert mlp_rt.disabled and not attn_rt.disabled
    assert attn_st.flush(30) and mlp_st.flush(30)

    admin = CollectorClient(collector.url)
    attn_run, mlp_run = admin.get_run(attn_rt.run_id), admin.get_run(mlp_rt.run_id)
    assert attn_run["run_key"] == "attn-run" and attn_run["candidate"]["name"] == "attn-cand"
    assert mlp_run["run_key"] == "mlp-run" and mlp_run["candidate"]["name"] == "mlp-cand"
    assert attn_run["samples"] == 12, "every attention call, none of the MLP's"
    assert mlp_run["samples"] == 1, "the MLP's one compared call (an error sample), then disabled"
    (attn_prod,) = httpx.get(f"{collector.url}/v1/runs/{attn_rt.run_id}/producers").json()
    (mlp_prod,) = httpx.get(f"{collector.url}/v1/runs/{mlp_rt.run_id}/producers").json()
    assert attn_prod["disabled_reason"] is None and mlp_prod["disabled_reason"] == "candidate modified its inputs"
    assert attn_prod["producer"] != mlp_prod["producer"]

    # the kill switch of one run reaches that run's sites only
    admin.set_mode(attn_rt.run_id, "off")
    assert wait_for(lambda: attn_rt.mode == "off", 20)
    time.sleep(0.5)  # two more polls of the other run: nothing for it
    assert mlp_rt.mode == "validate" and mlp_rt.override is None
    attn_st.close()
    mlp_st.close()


def test_a_runtime_from_env_refuses_an_empty_run_key() -> None:
    with pytest.raises(ValueError, match="run_key"):
        HookRuntime.from_env("  ", env={"SHADOWD_MODE": "validate"})
    with pytest.raises(ValueError, match="SHADOWD_SAMPLE"):
        HookRuntime.from_env("x", env={"SHADOWD_SAMPLE": "never"})
