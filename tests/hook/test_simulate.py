"""The demo's simulated workload: two different correct implementations, and the planted faults in both forms —
the live one the demo's candidate wraps and the importable full-size one its repro bundles name for replay."""

from __future__ import annotations

import math
import time

import pytest
import torch

from shadowd.hook import simulate as sim
from shadowd.hook.replay import resolve


@pytest.fixture(scope="module")
def case() -> tuple[object, ...]:
    return sim.make_case([40, 7], [8, 5], heads=4, seed=3)


def _rel_l2(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x.double() - y.double()).norm() / y.double().norm())


def test_baseline_and_candidate_differ_only_by_rounding(case: tuple[object, ...]) -> None:
    base, cand = sim.baseline_attention(*case), sim.candidate_attention(*case)
    assert base.shape == cand.shape == (13, 4, sim.D_V) and base.dtype == cand.dtype == torch.bfloat16
    assert 0 < _rel_l2(cand, base) < 2**-7, "real rounding differences, not zeros and not a bug"
    oracle = sim.oracle_attention(*case)
    assert _rel_l2(base, oracle) < 2**-7 and _rel_l2(cand, oracle) < 2**-7


def test_every_fault_ref_imports_its_full_size_candidate() -> None:
    assert set(sim.FAULT_REFS) == set(sim.FAULTS)
    assert resolve(sim.FAULT_REFS["none"]) is sim.candidate_attention
    for fault in ("nan", "bias", "drift", "crash"):
        assert resolve(sim.FAULT_REFS[fault]) is getattr(sim, f"{fault}_candidate")


def test_the_full_size_faults(case: tuple[object, ...]) -> None:
    base, cand = sim.baseline_attention(*case), sim.candidate_attention(*case)
    nan = sim.nan_candidate(*case)
    assert torch.isnan(nan).sum() == 4 and torch.isnan(nan[-1, 0, :4]).all()
    assert torch.equal(nan[:-1], cand[:-1]), "NaN planted in four elements, the rest is the candidate's"
    shift = (sim.bias_candidate(*case).double() - cand.double()).mean()
    assert math.isclose(float(shift), 2**-4 * float(cand.double().abs().max()), rel_tol=0.05)
    drift = sim.drift_candidate(*case).double() - base.double()
    assert math.isclose(float(drift.norm() / (cand.double() - base.double()).norm()), sim.DRIFT_GAIN, rel_tol=0.05)
    assert torch.equal(sim.crash_candidate(*case), cand), "trees up to CRASH_TREE tokens pass"
    big = sim.make_case([10], [sim.CRASH_TREE + 1], heads=2, seed=1)
    with pytest.raises(RuntimeError, match="unsupported tree size"):
        sim.crash_candidate(*big)


def test_the_live_faults_as_the_demo_plants_them(case: tuple[object, ...]) -> None:
    assert sim.faulty(sim.candidate_attention, "none") is sim.candidate_attention
    with pytest.raises(ValueError, match="fault must be one of"):
        sim.faulty(sim.candidate_attention, "gremlins")
    nan = sim.faulty(sim.candidate_attention, "nan")
    bad = [bool(torch.isnan(nan(*case)).any()) for _ in range(14)]
    assert [i + 1 for i, b in enumerate(bad) if b] == [7, 14], "NaN in 1 of 7 calls"
    # the drift starts at the candidate's own rounding and grows over duration_s
    drift = sim.faulty(sim.candidate_attention, "drift", duration_s=3600.0)
    assert torch.equal(drift(*case), sim.candidate_attention(*case))
    grown = sim.faulty(sim.candidate_attention, "drift", duration_s=1e-3)  # (the shortest ramp it takes)
    time.sleep(0.01)
    assert torch.equal(grown(*case), sim.drift_candidate(*case))
    crash = sim.faulty(sim.candidate_attention, "crash")
    with pytest.raises(RuntimeError, match="planted fault"):
        crash(*sim.make_case([10], [sim.CRASH_TREE + 1], heads=2, seed=1))
