"""Property tests of the judge (hypothesis)."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from shadowd.judge.inputs import RunRollups, StepCounts
from shadowd.judge.verdict import NOT_READY, READY, judge
from tests.judge.builders import SMALL, cell, rollups, slot, statuses

TOL = SMALL.tol("rel_l2_max")


@st.composite
def ready_runs(draw: st.DrawFn) -> RunRollups:
    layers = draw(st.integers(1, 4))
    n = draw(st.integers(100, 3000))
    rel = draw(st.floats(1e-5, TOL * 0.9))
    steps = draw(st.integers(500, 100_000))
    return rollups(num_layers=layers, n_per_layer=n, rel=rel, steps=steps, requests=draw(st.integers(10, 10_000)),
                   span=draw(st.floats(60.0, 1e5)))


@settings(max_examples=60, deadline=None)
@given(ready_runs(), st.integers(1, 5000), st.floats(0.0, TOL * 0.99), st.integers(0, 50_000), st.booleans())
def test_in_tolerance_samples_never_turn_ready_into_not_ready_except_by_drift(
        r: RunRollups, add: int, rel: float, add_steps: int, new_bucket: bool) -> None:
    before = judge(r, SMALL)
    if before["verdict"] != READY:
        return
    last = r.run["last_sample_ts"] + 30.0
    cells = list(r.cells)
    slots = list(r.slots)
    for lay in range(r.run["num_layers"]):
        extra = cell(lay, add, rel, bucket=(64, 16, 17, 8) if new_bucket else (4, 8, 13, 8))
        cells.append(extra)
        slots.append(slot(lay, last, add, rel))
    run = {**r.run, "last_sample_ts": last, "n_requests": r.run["n_requests"] + add,
           "n_samples": r.run["n_samples"] + add * r.run["num_layers"]}
    steps = StepCounts(r.steps.total + add_steps, r.steps.exceeded, r.steps.policy_hash)
    after = judge(dataclasses.replace(r, run=run, cells=cells, slots=slots, steps=steps, now=r.now + 30), SMALL)
    if after["verdict"] == NOT_READY:
        failed = {name for name, s in statuses(after).items() if s == "fail"}
        assert failed == {"drift"}, after["reasons"]


@st.composite
def any_runs(draw: st.DrawFn) -> RunRollups:
    layers = draw(st.integers(1, 4))
    return rollups(num_layers=layers, n_per_layer=draw(st.integers(0, 3000)),
                   rel=draw(st.one_of(st.floats(0.0, 1.0), st.just(float("nan")))),
                   steps=draw(st.integers(0, 100_000)), exceeded=0, requests=draw(st.integers(0, 10_000)),
                   span=draw(st.floats(0.0, 1e5)), recent_rel=draw(st.floats(0.0, 1.0)))


@settings(max_examples=60, deadline=None)
@given(any_runs(), st.data())
def test_one_nonfinite_mismatch_always_gives_not_ready(r: RunRollups, data: st.DataObject) -> None:
    lay = data.draw(st.integers(0, r.run["num_layers"] - 1))
    cells = [dict(c) for c in r.cells]
    cells[lay]["n_cand_nonfinite"] = 1
    run = {**r.run, "n_cand_nonfinite": 1}
    rep = judge(dataclasses.replace(r, cells=cells, run=run), SMALL)
    assert rep["verdict"] == NOT_READY
    assert statuses(rep)["hard_failures"] == "fail"
