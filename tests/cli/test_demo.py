"""`shadowd demo` end to end, as a user runs it: READY for a good candidate, NOT_READY with the
right reason for each planted fault (real collector process, real hook, real streamer)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("torch")

pytestmark = pytest.mark.slow

EXPECTED = {
    "nan": "hard_failures: FAIL",
    "bias": "tolerance: FAIL",
    "drift": "drift: FAIL",
    "crash": "hard_failures: FAIL",
}


def _demo(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shadowd", "demo", *args], capture_output=True, text=True,
                          timeout=300)


def test_demo_reaches_ready_for_a_good_candidate():
    done = _demo("--fault", "none")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "readiness verdict for run 1: READY" in done.stdout
    assert "DEMO policy" in done.stdout  # it says plainly what it judges with
    assert "status page" in done.stdout


@pytest.mark.parametrize("fault", sorted(EXPECTED))
def test_demo_planted_fault_is_not_ready_with_its_reason(fault):
    done = _demo("--fault", fault)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "readiness verdict for run 1: NOT_READY" in done.stdout
    assert EXPECTED[fault] in done.stdout, done.stdout


def test_demo_rejects_an_unknown_fault():
    done = _demo("--fault", "gremlins")
    assert done.returncode == 2 and "--fault must be one of" in done.stderr
