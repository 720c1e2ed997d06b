"""Per-process setup against a live collector: two TP ranks of one launch register one run and
stream as two producers; the run carries the model's layers, TP size, sglang version, both
fingerprints and SGLang's accept length per mode."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from shadowd.client import CollectorClient
from shadowd.hook.site import Bucket, ShadowSite
from tests.hook.conftest import Collector, base_fn, cand_fn, inputs


@pytest.fixture
def collector(tmp_path: Path) -> Any:
    c = Collector(tmp_path)
    c.start()
    yield c
    c.stop()


def _runner(rank: int) -> Any:
    return SimpleNamespace(model_config=SimpleNamespace(num_hidden_layers=3, model_path="moonshotai/Kimi-K2.6"),
                           tp_rank=rank, tp_size=2, device="cpu", is_draft_worker=False)


def test_two_ranks_register_one_run_and_stream(sgl: Any, collector: Collector, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import sglang

    from shadowd.sglang import process
    from shadowd.sglang.spec import SpecCounters

    monkeypatch.setattr(process, "_parallel", lambda mr: (mr.tp_rank, mr.tp_size, 0))
    env = {"SHADOWD_MODE": "validate", "SHADOWD_URL": collector.url, "SHADOWD_RUN_KEY": "launch-1",
           "SHADOWD_SPOOL_DIR": str(tmp_path / "spool"), "SHADOWD_FLUSH_INTERVAL_S": "0.1",
           "SHADOWD_RANK": "0"}  # one value for every worker: ignored, each reports its own TP rank
    runtimes = []
    for rank in (0, 1):
        spec = SpecCounters()
        setup = process.ProcessSetup(sglang.__version__, spec, env=env)
        rt = setup.setup(_runner(rank))
        assert setup.setup(_runner(rank)) is rt, "once per process"
        spec.counts.update(spec_accept_tokens_validate=60, spec_req_steps_validate=20, spec_passes_validate=5)
        runtimes.append(rt)
    deadline = time.monotonic() + 30
    while any(rt.run_id is None for rt in runtimes) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert runtimes[0].run_id is not None and runtimes[0].run_id == runtimes[1].run_id, "one run per launch"
    x, w = inputs()
    for rt in runtimes:
        site = ShadowSite("sglang.mla_tree_verify", base_fn, cand_fn, runtime=rt)
        for layer in range(3):
            out = site(x, w, layer=layer, bucket=Bucket(batch_size=2, draft_tokens=8, prefix_len=4096, heads=8))
            assert out.equal(base_fn(x, w))
        assert rt.streamer is not None and rt.streamer.flush(20.0)
    client = CollectorClient(collector.url)
    run = client.get_run(runtimes[0].run_id)
    assert run["num_layers"] == 3 and run["tp_size"] == 2 and run["sglang_version"] == sglang.__version__
    assert run["model"].endswith("Kimi-K2.6") and run["run_key"] == "launch-1"
    assert run["candidate"]["name"] == "mla_tree_verify" and run["candidate"]["fingerprint"]
    assert run["baseline"]["fingerprint"] and run["samples"] == 6
    assert run["speculative"]["validate"]["accept_length"] == 3.0
    import httpx

    producers = {p["rank"] for p in httpx.get(f"{collector.url}/v1/runs/{run['id']}/producers").json()}
    assert producers == {0, 1}, "each rank is its own producer (SHADOWD_RANK does not merge them)"
    for rt in runtimes:
        rt.streamer.close(2.0)


Place = tuple[dict[str, Any], tuple[int, int, int]]


def _launch(collector: Collector, tmp_path: Path, key: str, places: list[Place],
            layers: Callable[[Any], tuple[int, ...]] = lambda rt: (0,)
            ) -> tuple[list[Any], dict[str, Any], list[dict[str, Any]]]:
    """One worker per place — SGLang's parallel context overridden as given, ``_parallel`` checked to say
    (rank, ranks, stage) — each with a validate site called once per layer of ``layers(runtime)``; returns the
    runtimes, the one run they registered and its producer rows."""
    import httpx
    import sglang
    from sglang.srt.runtime_context import get_parallel

    from shadowd.sglang import process
    from shadowd.sglang.spec import SpecCounters

    env = {"SHADOWD_MODE": "validate", "SHADOWD_URL": collector.url, "SHADOWD_RUN_KEY": key,
           "SHADOWD_SPOOL_DIR": str(tmp_path / "spool"), "SHADOWD_FLUSH_INTERVAL_S": "0.1"}
    runtimes = []
    for override, expected in places:
        with get_parallel().override(**override):
            assert process._parallel(_runner(override["tp_rank"])) == expected
            runtimes.append(process.ProcessSetup(sglang.__version__, SpecCounters(), env=env)
                            .setup(_runner(override["tp_rank"])))
    deadline = time.monotonic() + 30
    while any(rt.run_id is None for rt in runtimes) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len({rt.run_id for rt in runtimes}) == 1 and runtimes[0].run_id is not None, "one run per launch"
    x, w = inputs()
    for rt in runtimes:
        site = ShadowSite("sglang.mla_tree_verify", base_fn, cand_fn, runtime=rt)
        for layer in layers(rt):
            site(x, w, layer=layer, bucket=Bucket(batch_size=2, draft_tokens=8, prefix_len=4096, heads=8))
        assert rt.streamer is not None and rt.streamer.flush(20.0)
    run = CollectorClient(collector.url).get_run(runtimes[0].run_id)
    producers = httpx.get(f"{collector.url}/v1/runs/{run['id']}/producers").json()
    for rt in runtimes:
        rt.streamer.close(2.0)
    return runtimes, run, producers


def test_the_replicas_of_a_data_parallel_launch_report_as_ranks_of_their_own(sgl: Any, collector: Collector,
                                                                             tmp_path: Path) -> None:
    # --dp-size 2 --tp 2: each replica is a TP group whose ranks count from 0. Reported under their TP rank alone,
    # two live workers shared a rank: a rank's producer figures are its latest producer's, so the other
    # replica's drops or disabled candidate vanished from the gauges and alerts, and the coverage criterion
    # asked nothing of the second replica.
    from sglang.srt.runtime_context import get_parallel

    from shadowd.sglang import process

    places = [({"tp_rank": k, "tp_size": 2, "dp_rank": replica, "dp_size": 2}, (replica * 2 + k, 4, 0))
              for replica in (0, 1) for k in (0, 1)]
    runtimes, run, producers = _launch(collector, tmp_path, "dp-launch", places)
    assert [rt.config.rank for rt in runtimes] == [0, 1, 2, 3]
    assert run["tp_size"] == 4
    assert sorted(p["rank"] for p in producers) == [0, 1, 2, 3], "four workers, four ranks"
    with get_parallel().override(tp_rank=1, tp_size=2, dp_rank=None, dp_size=1):  # no DP controller
        assert process._parallel(_runner(1)) == (1, 2, 0)


def test_the_stages_of_a_pipeline_parallel_launch_are_producers_of_their_own(sgl: Any, collector: Collector,
                                                                            tmp_path: Path) -> None:
    # --pp-size 2 --tp 2 (SGLANG_ENABLE_PP_SPEC=1): stage 0 runs layer 0, stage 1 layers 1-2, each with TP ranks
    # 0 and 1, all four on one host. Without the stage the two stages' workers of one TP rank shared a spool
    # directory, and the collector's figures for the rank were whichever stage started last.
    places = [({"tp_rank": k, "tp_size": 2, "pp_rank": stage, "pp_size": 2, "dp_rank": None, "dp_size": 1},
               (k, 2, stage)) for stage in (0, 1) for k in (0, 1)]
    runtimes, run, producers = _launch(collector, tmp_path, "pp-launch", places,
                                       layers=lambda rt: (0,) if rt.config.stage == 0 else (1, 2))
    assert [(rt.config.stage, rt.config.rank) for rt in runtimes] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert len({rt.streamer.spool.root for rt in runtimes}) == 4, "a spool directory each"
    assert run["tp_size"] == 2 and run["samples"] == 6
    assert sorted((p["stage"], p["rank"]) for p in producers) == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_on_mode_whose_run_registration_is_refused_serves_the_baseline(sgl: Any, collector: Collector,
                                                                      tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # a refused registration (a token the collector does not take, a run key reused for another candidate) left
    # on mode serving the candidate with no kill switch and no reports
    import sglang

    from shadowd.sglang import process
    from shadowd.sglang.spec import SpecCounters

    monkeypatch.setattr(process, "_parallel", lambda mr: (mr.tp_rank, mr.tp_size, 0))
    env = {"SHADOWD_MODE": "on", "SHADOWD_URL": collector.url + "/nowhere", "SHADOWD_RUN_KEY": "refused",
           "SHADOWD_SPOOL_DIR": str(tmp_path / "spool")}  # (a path the collector answers 404: refused)
    rt = process.ProcessSetup(sglang.__version__, SpecCounters(), env=env).setup(_runner(0))
    deadline = time.monotonic() + 30
    while rt.mode != "off" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert rt.mode == "off" and rt.streamer is None and rt.run_id is None


def test_on_mode_behind_a_promotion_gate_serves_the_baseline_until_the_gate_run_is_ready(
        sgl: Any, collector: Collector, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sglang

    from shadowd.sglang import process
    from shadowd.sglang.spec import SpecCounters

    monkeypatch.setattr(process, "_parallel", lambda mr: (mr.tp_rank, mr.tp_size, 0))
    with CollectorClient(collector.url) as c:  # the validate launch of the same build, model and TP size
        fields = process.run_fields("validate-launch", 3, 2, sglang.__version__, "moonshotai/Kimi-K2.6")
        gate = int(c.register_run(fields)["id"])
    env = {"SHADOWD_MODE": "on", "SHADOWD_URL": collector.url, "SHADOWD_RUN_KEY": "on-launch",
           "SHADOWD_SPOOL_DIR": str(tmp_path / "spool"), "SHADOWD_GATE_RUN": str(gate)}
    rt = process.ProcessSetup(sglang.__version__, SpecCounters(), env=env).setup(_runner(0))
    assert rt.mode == "validate" and rt.gate_held, "held from the start, before the collector answers"
    deadline = time.monotonic() + 30
    while not str(rt.gate_reason).startswith(f"run {gate} is") and time.monotonic() < deadline:
        time.sleep(0.1)
    # same deployment (no mismatch named), but the gate run has no samples: not READY, so the gate holds
    assert rt.gate_reason is not None and rt.gate_reason.startswith(f"run {gate} is INSUFFICIENT_DATA"), rt.gate_reason
    assert rt.run_id is not None and rt.run_id != gate
    x, w = inputs()
    site = ShadowSite("sglang.mla_tree_verify", base_fn, cand_fn, runtime=rt)
    assert site(x, w, layer=0, bucket=Bucket(batch_size=2, draft_tokens=8, prefix_len=4096, heads=8)).equal(
        base_fn(x, w))
    rt.gate.stop(5)
    rt.streamer.close(2.0)


def test_a_multi_node_launch_without_a_run_key_is_told_to_set_one(sgl: Any, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    import logging

    import sglang

    from shadowd.sglang import process
    from shadowd.sglang.spec import SpecCounters

    monkeypatch.setattr(process, "_parallel", lambda mr: (mr.tp_rank, mr.tp_size, 0))
    monkeypatch.setattr(process.ProcessSetup, "_start_streamer", lambda self, rt, fields: None)
    runner = _runner(0)
    runner.server_args = SimpleNamespace(nnodes=2)
    base = {"SHADOWD_MODE": "validate", "SHADOWD_URL": "http://127.0.0.1:9", "SHADOWD_SPOOL_DIR": str(tmp_path)}
    with caplog.at_level(logging.ERROR, logger="shadowd"):
        process.ProcessSetup(sglang.__version__, SpecCounters(), env=base).setup(runner)
    assert "2-node launch without SHADOWD_RUN_KEY" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="shadowd"):
        process.ProcessSetup(sglang.__version__, SpecCounters(), env={**base, "SHADOWD_RUN_KEY": "k"}).setup(runner)
    assert "SHADOWD_RUN_KEY" not in caplog.text
