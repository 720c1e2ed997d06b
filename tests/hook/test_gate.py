"""The promotion gate: on mode serves the candidate only once the collector judged this very build READY."""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

import httpx
import pytest
import torch

from shadowd.client import CollectorClient
from shadowd.hook.config import HookConfig
from shadowd.hook.gate import PromotionGate, gate_decision, mismatches
from shadowd.hook.site import Bucket, ShadowSite
from tests.hook.conftest import RUN, Collector, base_fn, cand_fn, inputs, make_runtime, run_body, wait_for

GATE = 7
OWN = dict(RUN, run_key="on-run")


class FakeCollector:
    """``GET /v1/runs/7`` and ``GET /readiness?run_id=7`` answered from settable fields."""

    def __init__(self, verdict: str = "NOT_READY", run: dict[str, Any] | None = None) -> None:
        self.verdict = verdict
        self.run = dict(RUN, id=GATE, run_key="validate-run") if run is None else run
        self.down = False
        self.asked: list[str] = []
        #: the readiness body's covered_shapes (None: left out); the toy calls' shape, Bucket() — [1, 1, 0] — by default
        self.shapes: list[list[int]] | None = [[1, 1, 0]]

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.asked.append(request.url.path)
        if self.down:
            raise httpx.ConnectError("refused", request=request)
        if request.url.path == f"/v1/runs/{GATE}":
            return httpx.Response(200, json=self.run)
        if request.url.path == "/readiness" and request.url.params.get("run_id") == str(GATE):
            body = {"run_id": GATE, "verdict": self.verdict,
                    "reasons": [] if self.verdict == "READY" else ["exceedance 3 %"],
                    "candidate_fingerprint": self.run["candidate"]["fingerprint"]}
            if self.shapes is not None:
                body["covered_shapes"] = self.shapes
            return httpx.Response(200 if self.verdict == "READY" else 503, json=body)
        return httpx.Response(404, json={"detail": f"run {request.url.path} not found"})


def gated_runtime(**kw: Any) -> tuple[Any, Any]:
    return make_runtime("on", gate_run=GATE, spot_every=1000, url="http://collector.invalid", **kw)


def client_for(fake: FakeCollector) -> CollectorClient:
    return CollectorClient("http://collector.invalid", transport=httpx.MockTransport(fake))


# ---- configuration ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("raw", ["abc", "0", "-3", "7.5"])
def test_a_bad_gate_run_is_refused_naming_the_variable(raw: str) -> None:
    with pytest.raises(ValueError, match="SHADOWD_GATE_RUN"):
        HookConfig.from_env({"SHADOWD_MODE": "on", "SHADOWD_URL": "http://c:8787", "SHADOWD_GATE_RUN": raw})


def test_on_mode_with_a_gate_needs_a_collector() -> None:
    with pytest.raises(ValueError, match="SHADOWD_GATE_RUN needs SHADOWD_URL"):
        HookConfig.from_env({"SHADOWD_MODE": "on", "SHADOWD_GATE_RUN": "7"})
    cfg = HookConfig.from_env({"SHADOWD_MODE": "on", "SHADOWD_URL": "http://c:8787", "SHADOWD_GATE_RUN": " 7 "})
    assert cfg.gate_run == 7
    assert HookConfig.from_env({"SHADOWD_MODE": "on"}).gate_run is None


# ---- the runtime's modes ---------------------------------------------------------------------------------------
def test_a_held_gate_serves_validate_and_graphs_are_built_for_on() -> None:
    rt, _ = gated_runtime()
    assert (rt.mode, rt.capture_code, rt.gate_held) == ("validate", 2, True)
    rt.set_override("off")  # the kill switch lowers below the hold, for graphs too
    assert (rt.mode, rt.capture_code) == ("off", 0)
    rt.set_override(None)
    assert (rt.mode, rt.capture_code) == ("validate", 2)
    rt.open_gate("test")
    assert (rt.mode, rt.mode_code, rt.gate_held) == ("on", 2, False)
    rt.set_override("validate")  # the kill switch still acts once the gate is open
    assert rt.mode == "validate"


def test_validate_mode_ignores_the_gate() -> None:
    rt, _ = make_runtime("validate", gate_run=GATE)
    assert (rt.mode, rt.gate_held) == ("validate", False)
    assert rt.start_gate(object(), OWN) is None


# ---- the decision ----------------------------------------------------------------------------------------------
def test_the_decision_opens_only_on_ready_for_this_deployment() -> None:
    run = dict(RUN, id=GATE)
    ready = {"run_id": GATE, "verdict": "READY", "candidate_fingerprint": "c1"}
    assert gate_decision(GATE, run, ready, OWN)[0] is True
    opened, why = gate_decision(GATE, run, {"run_id": GATE, "verdict": "NOT_READY", "reasons": ["layer 3 drifts"]},
                                OWN, 503)
    assert opened is None and why == "run 7 is NOT_READY: layer 3 drifts"
    other = dict(run, candidate={"name": "cand", "fingerprint": "c0"}, tp_size=2)
    opened, why = gate_decision(GATE, other, ready, OWN)
    assert opened is False
    assert "candidate fingerprint 'c0' there, 'c1' here" in why and "TP size 2 there, 1 here" in why


def test_a_process_without_a_candidate_fingerprint_never_opens() -> None:
    own = {k: v for k, v in OWN.items() if k != "candidate"}
    assert mismatches(dict(RUN), own) == ["candidate fingerprint 'c1' there, None here"]
    own_partial = {"candidate": {"fingerprint": "c1"}}  # only what the process declares is compared beside it
    assert mismatches(dict(RUN, model="other"), own_partial) == []


# ---- the gate in front of a call site --------------------------------------------------------------------------
def test_the_candidate_is_served_only_once_the_gate_run_is_ready() -> None:
    rt, sink = gated_runtime()
    site = ShadowSite("s", base_fn, cand_fn, runtime=rt)
    x, w = inputs()
    assert not torch.equal(base_fn(x, w), cand_fn(x, w))
    fake = FakeCollector("NOT_READY")
    gate = PromotionGate(rt, client_for(fake), GATE, OWN)
    assert gate.check() is None
    for _ in range(3):
        assert torch.equal(site(x, w, layer=0), base_fn(x, w)), "held: the baseline is served"
    assert sink[-1]["mode"] == "validate", "and the candidate compared as in validate"
    assert rt.gate_reason == "run 7 is NOT_READY: exceedance 3 %"
    fake.verdict = "READY"
    assert gate.check() is True and gate.done.is_set()
    outs = [site(x, w, layer=0) for _ in range(3)]
    assert all(torch.equal(o, cand_fn(x, w)) for o in outs), "open: the candidate is served"


def test_on_mode_serves_the_candidate_only_on_the_shapes_the_verdict_covered(caplog: pytest.LogCaptureFixture) -> None:
    """The gate opens on a verdict over trees of up to 16 nodes and prefixes of 4096-8191 tokens, batches of one: a
    call of that shape gets the candidate; a first 200k-token prefix, a 17-node tree or a batch of two gets the
    baseline (and is compared, as in validate, to gather evidence for its bucket)."""
    rt, sink = gated_runtime()
    site = ShadowSite("s", base_fn, cand_fn, runtime=rt)
    x, w = inputs()
    fake = FakeCollector("READY")
    fake.shapes = [[1, 16, 13]]
    with caplog.at_level(logging.WARNING, logger="shadowd.hook"):
        assert PromotionGate(rt, client_for(fake), GATE, OWN).check() is True
    assert "the candidate is served on its 1 shape buckets (trees up to 16 nodes, prefixes below 8192 tokens)" in (
        caplog.text)
    served = {}
    for name, bucket in {"seen": Bucket(batch_size=1, draft_tokens=16, prefix_len=5000),
                         "long prefix": Bucket(batch_size=1, draft_tokens=16, prefix_len=200_000),
                         "larger tree": Bucket(batch_size=1, draft_tokens=17, prefix_len=5000),
                         "larger batch": Bucket(batch_size=2, draft_tokens=16, prefix_len=5000)}.items():
        before = len(sink)
        out = site(x, w, layer=0, bucket=bucket)
        served[name] = ("cand" if torch.equal(out, cand_fn(x, w)) else "base" if torch.equal(out, base_fn(x, w))
                        else "?", [s["mode"] for s in sink[before:]])
    # (the first call is checked: the site has not seen its output yet; the others are compared as validate calls)
    assert served == {"seen": ("cand", ["on"]), "long prefix": ("base", ["validate"]),
                      "larger tree": ("base", ["validate"]), "larger batch": ("base", ["validate"])}, served
    # how much of on mode's traffic the verdict covers rides to the collector with every batch
    stats = rt.producer_stats()
    assert (stats["on_covered_calls"], stats["on_uncovered_calls"]) == (1, 3), stats
    rt.fall_back("test")  # the baseline serves every call now: no on-mode shape to count
    site(x, w, layer=0, bucket=Bucket(batch_size=1, draft_tokens=16, prefix_len=5000))
    assert rt.on_shape_calls() == (1, 3)


def test_once_open_the_gate_follows_the_verdict_and_serves_the_shapes_it_comes_to_cover(
        caplog: pytest.LogCaptureFixture) -> None:
    """The validate run keeps collecting evidence after the gate opened: a later READY verdict that covers more
    shapes widens the set served on (a shape once covered stays covered, even if a later verdict leaves it out); a
    verdict that is no longer READY changes nothing and says so, once."""
    rt, _sink = gated_runtime()
    site = ShadowSite("s", base_fn, cand_fn, runtime=rt)
    x, w = inputs()
    fake = FakeCollector("READY")
    fake.shapes = [[1, 16, 13]]
    gate = PromotionGate(rt, client_for(fake), GATE, OWN)
    assert gate.check() is True and gate.opened
    seen, longer = Bucket(batch_size=1, draft_tokens=16, prefix_len=5000), Bucket(batch_size=1, draft_tokens=16,
                                                                                  prefix_len=20_000)

    def served(bucket: Bucket) -> str:
        site(x, w, layer=0, bucket=bucket)  # (the site's first sight of an output shape is checked: call twice)
        out = site(x, w, layer=0, bucket=bucket)
        return "cand" if torch.equal(out, cand_fn(x, w)) else "base" if torch.equal(out, base_fn(x, w)) else "?"

    assert (served(seen), served(longer)) == ("cand", "base")
    assert gate.follow() == 0, "the same verdict: nothing to add"
    fake.shapes = [[1, 16, 15]]  # prefixes of 16384-32767 tokens validated since (the earlier bucket left out)
    with caplog.at_level(logging.WARNING, logger="shadowd.hook"):
        assert gate.follow() == 1
    assert "covers 1 more shape buckets: the candidate is now served on its 2 shape buckets" in caplog.text
    assert (served(seen), served(longer)) == ("cand", "cand")
    fake.verdict = "NOT_READY"
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="shadowd.hook"):
        assert gate.follow() is None and gate.follow() is None
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "the candidate is still served on the shapes the gate opened on" in errors[0].message
    assert served(longer) == "cand" and rt.mode == "on"
    fake.down = True
    assert gate.follow() is None and len(rt.coverage.shapes) == 2


def test_the_watcher_thread_keeps_following_after_the_gate_opened() -> None:
    rt, _sink = gated_runtime()
    fake = FakeCollector("READY")
    fake.shapes = [[1, 16, 13]]
    gate = PromotionGate(rt, client_for(fake), GATE, OWN, interval_s=0.01, follow_s=0.01).start()
    try:
        assert gate.done.wait(10) and gate.opened
        fake.shapes = [[1, 16, 13], [2, 16, 13]]
        assert wait_for(lambda: len(rt.coverage.shapes) == 2, 10)
    finally:
        gate.stop(5)
    assert gate._thread is not None and not gate._thread.is_alive()


def test_a_ready_verdict_that_names_no_shapes_keeps_the_gate_held() -> None:
    """A READY answer without ``covered_shapes`` (a collector older than the hook) says nothing about which shapes
    the candidate was judged on: the gate holds (asked again later), the baseline served."""
    rt, _ = gated_runtime()
    fake = FakeCollector("READY")
    fake.shapes = None
    gate = PromotionGate(rt, client_for(fake), GATE, OWN)
    assert gate.check() is None and not gate.done.is_set() and rt.mode == "validate"
    assert "run 7 is READY, but covered_shapes: the verdict does not say which shapes it covers" in str(
        rt.gate_reason)
    fake.shapes = [[1, 1, 0], [2, 1, 0]]
    assert gate.check() is True and rt.mode == "on"
    assert rt.coverage is not None and rt.coverage.shapes == {(0, 0, 0), (1, 0, 0)}


def test_a_gate_run_of_another_build_holds_for_good(caplog: pytest.LogCaptureFixture) -> None:
    rt, _ = gated_runtime()
    fake = FakeCollector("READY", run=dict(RUN, id=GATE, candidate={"name": "cand", "fingerprint": "c-old"}))
    gate = PromotionGate(rt, client_for(fake), GATE, OWN)
    with caplog.at_level(logging.ERROR, logger="shadowd.hook"):
        assert gate.check() is False
    assert rt.mode == "validate" and gate.done.is_set()
    assert "for the life of this process" in caplog.text and "'c-old' there, 'c1' here" in caplog.text


def test_an_unreachable_collector_keeps_the_gate_held_and_is_retried() -> None:
    rt, _ = gated_runtime()
    fake = FakeCollector("READY")
    fake.down = True
    gate = PromotionGate(rt, client_for(fake), GATE, OWN, interval_s=0.01).start()
    try:
        while len(fake.asked) < 3:  # asked again and again while the collector is down
            gate.done.wait(0.01)
        assert rt.mode == "validate" and "could not be asked" in str(rt.gate_reason)
        fake.down = False
        assert gate.done.wait(10), "opens once the collector answers READY"
    finally:
        gate.stop(5)
    assert rt.mode == "on"


def test_an_unknown_gate_run_holds_for_good() -> None:
    rt, _ = gated_runtime()
    fake = FakeCollector("READY")
    gate = PromotionGate(rt, client_for(fake), 99, OWN)
    assert gate.check() is False and rt.mode == "validate"
    assert "refused" in str(rt.gate_reason) and "99" in str(rt.gate_reason)


def test_start_streaming_watches_the_gate_against_a_real_collector(collector: Collector, tmp_path: Any) -> None:
    """Registered with a real collector: the gate run there is of another build, so the gate stays held."""
    with CollectorClient(collector.url) as c:
        gate_id = int(c.register_run(dict(run_body("validate-run"),
                                          candidate={"name": "cand", "fingerprint": "c-old"}))["id"])
    rt, _ = make_runtime("on", gate_run=gate_id, url=collector.url, spool_dir=tmp_path, poll_interval_s=0.05)
    streamer = rt.start_streaming(run_body("on-run"))
    try:
        assert rt.gate is not None and rt.gate.done.wait(20)
        assert rt.mode == "validate" and rt.gate_held
        assert json.dumps(rt.gate_reason).count("c-old") == 1
    finally:
        rt.gate.stop(5)
        streamer.close(2.0)


# ---- races, answers not for this run, logging ------------------------------------------------------------------
class _Interleave(logging.Handler):
    """Runs ``action`` in another thread the first time a record whose message contains ``marker`` is logged, and
    waits (briefly) for it to finish: a deterministic interleaving of two threads at that point of the code."""

    def __init__(self, marker: str, action: Any) -> None:
        super().__init__(logging.DEBUG)
        self.marker, self.action, self.fired = marker, action, False
        self.thread: threading.Thread | None = None

    def createLock(self) -> None:
        # no I/O lock: the other thread logs too, and must not wait for this emit (that would serialise the threads)
        self.lock = None  # type: ignore[assignment]

    def emit(self, record: logging.LogRecord) -> None:
        if self.fired or self.marker not in record.getMessage():
            return
        self.fired = True
        self.thread = threading.Thread(target=self.action)
        self.thread.start()
        self.thread.join(0.5)  # (a runtime that serialises mode changes keeps the other thread waiting: it goes on)


def test_a_kill_switch_that_lands_while_the_gate_opens_is_not_lost() -> None:
    """The streamer's thread applies the kill switch while the gate's thread is opening the gate: whatever the
    interleaving, the mode ends up off (the collector's kill switch always wins)."""
    rt, _ = gated_runtime()
    log = logging.getLogger("shadowd.hook")
    hook = _Interleave("mode validate -> on", lambda: rt.set_override("off"))
    log.addHandler(hook)
    try:
        opener = threading.Thread(target=rt.open_gate, args=("test",))
        opener.start()
        opener.join(5)
    finally:
        log.removeHandler(hook)
    assert hook.fired and hook.thread is not None
    hook.thread.join(5)
    assert (rt.override, rt.mode, rt.mode_code) == ("off", "off", 0), "the kill switch says off: nothing is served"


def test_a_child_forked_while_another_thread_changes_the_mode_can_still_change_it() -> None:
    """The mode lock held by a thread of the parent at the fork (a thread the child does not have): the child's kill
    switch and sticky flags must not wait for it forever."""
    import os
    import signal

    rt, _ = gated_runtime()
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        with rt._mode_lock:
            holding.set()
            release.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    assert holding.wait(5)
    pid = os.fork()
    if pid == 0:  # the child: report through the exit status only
        ok = False
        try:
            signal.alarm(10)
            rt.set_override("off")
            rt.fall_back("test")
            ok = rt.mode == "off" and rt.fallback
        finally:
            os._exit(0 if ok else 1)
    release.set()
    t.join(5)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child changed its mode without waiting for a dead thread"


class LyingCollector(FakeCollector):
    """Answers for run 7 with bodies that are not quite about run 7 (``mend`` rewrites the readiness body, ``run``
    is the run body)."""

    def __init__(self, mend: Any, run: dict[str, Any] | None = None, status: int = 200) -> None:
        super().__init__("READY", run)
        self.mend, self.status = mend, status

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/readiness":
            self.asked.append(request.url.path)
            body = {"run_id": GATE, "run_key": "validate-run", "verdict": "READY", "reasons": [],
                    "candidate_fingerprint": self.run["candidate"]["fingerprint"], "covered_shapes": [[1, 1, 0]]}
            return httpx.Response(self.status, json=self.mend(body))
        return super().__call__(request)


@pytest.mark.parametrize("case", ["verdict of another run", "verdict without a run", "verdict of another candidate",
                                  "verdict without a candidate", "READY answered 503", "run body of another run",
                                  "readiness body not an object", "run body not an object"])
def test_a_ready_answer_that_is_not_about_the_gate_run_keeps_the_gate_held(case: str) -> None:
    """A collector (or a proxy) that ignores ``?run_id=`` answers the latest run's verdict — this process's own run,
    fed by its held validate traffic: that READY is no evidence for run 7, nor is one judged for another candidate."""
    run: dict[str, Any] = dict(RUN, id=GATE, run_key="validate-run")
    mend: Any = lambda b: b  # noqa: E731
    status = 200
    if case == "verdict of another run":
        mend = lambda b: dict(b, run_id=GATE + 1, run_key="on-run")  # noqa: E731
    elif case == "verdict without a run":
        mend = lambda b: {k: v for k, v in b.items() if k != "run_id"}  # noqa: E731
    elif case == "verdict of another candidate":
        mend = lambda b: dict(b, candidate_fingerprint="c-other")  # noqa: E731
    elif case == "verdict without a candidate":
        mend = lambda b: {k: v for k, v in b.items() if k != "candidate_fingerprint"}  # noqa: E731
    elif case == "READY answered 503":
        status = 503
    elif case == "run body of another run":
        run = dict(run, id=GATE + 1)
    elif case == "readiness body not an object":
        mend = lambda b: [b]  # noqa: E731
    rt, _ = gated_runtime()
    fake = LyingCollector(mend, run, status)
    if case == "run body not an object":
        real = fake.__call__

        def listed(request: httpx.Request) -> httpx.Response:
            resp = real(request)
            return httpx.Response(200, json=[resp.json()]) if request.url.path == f"/v1/runs/{GATE}" else resp

        client = CollectorClient("http://collector.invalid", transport=httpx.MockTransport(listed))
    else:
        client = client_for(fake)
    gate = PromotionGate(rt, client, GATE, OWN)
    assert gate.check() is not True
    assert (rt.mode, rt.gate_held) == ("validate", True), rt.gate_reason
    assert rt.gate_reason and "READY for" not in rt.gate_reason


def test_the_gate_opens_on_the_real_answer_shape() -> None:
    rt, _ = gated_runtime()
    assert PromotionGate(rt, client_for(LyingCollector(lambda b: b)), GATE, OWN).check() is True
    assert rt.mode == "on"


def test_one_line_per_state_of_the_gate_not_one_per_poll(caplog: pytest.LogCaptureFixture) -> None:
    """A validate run still collecting evidence has a first reason whose numbers move with every evaluation: the
    operator gets a line when the verdict or its failing criterion changes, not one every poll (per rank)."""
    rt, _ = gated_runtime()
    fake = FakeCollector("INSUFFICIENT_DATA")
    reasons = iter(f"requests: NEED MORE DATA: {n} distinct requests seen (need 5000)" for n in range(100, 10**6, 100))
    real = fake.__call__

    def moving(request: httpx.Request) -> httpx.Response:
        resp = real(request)
        if request.url.path == "/readiness":
            return httpx.Response(resp.status_code, json=dict(resp.json(), reasons=[next(reasons)]))
        return resp

    gate = PromotionGate(rt, CollectorClient("http://collector.invalid", transport=httpx.MockTransport(moving)),
                         GATE, OWN)
    with caplog.at_level(logging.INFO, logger="shadowd.hook"):
        for _ in range(5):
            assert gate.check() is None
        held = [r for r in caplog.records if "promotion gate held (" in r.getMessage()]
        assert len(held) == 1, [r.getMessage() for r in held]
        assert rt.gate_reason is not None and "500 distinct requests" in rt.gate_reason, "the reason is current"
        fake.down = True
        for _ in range(3):
            assert gate.check() is None
        fake.down = False
        fake.verdict = "NOT_READY"
        for _ in range(3):
            assert gate.check() is None
    held = [r.getMessage() for r in caplog.records if "promotion gate held (" in r.getMessage()]
    assert len(held) == 3, held  # still collecting; the collector away; the verdict turned NOT_READY
    assert "could not be asked" in held[1] and "NOT_READY" in held[2]


def test_a_check_that_keeps_failing_logs_its_traceback_once(caplog: pytest.LogCaptureFixture) -> None:
    rt, _ = gated_runtime()
    calls: list[int] = []

    class Broken:
        def get_run(self, run_id: int) -> Any:
            calls.append(run_id)
            raise RuntimeError("broken")

    gate = PromotionGate(rt, Broken(), GATE, OWN, interval_s=0.01).start()
    try:
        while len(calls) < 5:
            gate.done.wait(0.01)
    finally:
        gate.stop(5)
    assert rt.mode == "validate" and "broken" in str(rt.gate_reason)
    assert len([r for r in caplog.records if "check failed" in r.getMessage()]) == 1


def test_the_opening_line_says_when_the_kill_switch_keeps_the_candidate_off(caplog: pytest.LogCaptureFixture) -> None:
    rt, _ = gated_runtime()
    rt.set_override("validate")
    rt.open_gate("run 7 is READY for candidate c1")
    assert rt.mode == "validate"
    assert "the kill switch holds mode validate" in caplog.text


def test_a_gate_run_that_is_this_process_s_own_run_is_named(caplog: pytest.LogCaptureFixture) -> None:
    """The on-mode deployment registered under the validate run's key: its gate run is its own run, which its held
    validate traffic feeds — the gate then opens by itself once that traffic makes it READY. Legitimate evidence
    (this very build and deployment), but not the step-3 verdict a person looked at: said once, at the start."""
    rt, _ = gated_runtime()
    rt.run_id = GATE

    gate = rt.start_gate(client_for(FakeCollector()), OWN)
    gate.stop(5)
    assert "is this process's own run" in caplog.text


def test_a_child_forked_while_the_gate_is_held_watches_the_gate_itself() -> None:
    """The gate's thread is not in a forked child (like the streamer's, which makes its own there): without one of
    its own the child would stay held for good, silently."""
    import os
    import signal

    rt, _ = gated_runtime()
    fake = FakeCollector("NOT_READY")
    gate = PromotionGate(rt, client_for(fake), GATE, OWN, interval_s=0.02).start()
    rt.gate = gate
    try:
        while len(fake.asked) < 2:
            gate.done.wait(0.01)
        pid = os.fork()
        if pid == 0:  # the child: report through the exit status only
            ok = False
            try:
                signal.alarm(20)
                fake.verdict = "READY"  # (the child's copy of the fake collector)
                ok = rt.gate.done.wait(10) and rt.mode == "on"
            finally:
                os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "the child's gate opened once its collector said READY"
        assert rt.mode == "validate" and not gate.done.is_set(), "the parent's gate is its own"
    finally:
        gate.stop(5)


def test_a_child_forked_after_the_gate_opened_follows_the_verdict_itself() -> None:
    """Once open, the gate's thread follows the verdict; a forked child has no such thread, so it starts its own:
    a later READY verdict covering more shapes widens the child's set too."""
    import os
    import signal

    rt, _ = gated_runtime()
    fake = FakeCollector("READY")
    fake.shapes = [[1, 16, 13]]
    gate = PromotionGate(rt, client_for(fake), GATE, OWN, interval_s=0.01, follow_s=0.02).start()
    rt.gate = gate
    try:
        assert gate.done.wait(10) and gate.opened and len(rt.coverage.shapes) == 1
        pid = os.fork()
        if pid == 0:  # the child: report through the exit status only
            ok = False
            try:
                signal.alarm(20)
                fake.shapes = [[1, 16, 13], [2, 16, 13]]  # (the child's copy of the fake collector)
                ok = wait_for(lambda: len(rt.coverage.shapes) == 2, 10) and rt.mode == "on"
            finally:
                os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "the child widened its shapes from its own follow-up"
        assert len(rt.coverage.shapes) == 1, "the parent's collector still covers one shape"
    finally:
        gate.stop(5)
