"""The repro-bundle capture's decisions on the CPU (its device copies are exercised by tests/hook/test_gpu.py)."""

from __future__ import annotations

from shadowd.hook.capture import Captures, breach

OK = {"cand_nonfinite": 0, "max_abs": 1e-3, "rel_l2": 1e-3, "out_scale": 1.0}


def test_breach_is_the_cpu_paths_rule() -> None:
    limits = (0.25, 0.1, 0.016)  # hard scaled max-abs, hard rel-L2, bundle tolerance
    assert breach(OK, *limits) is None
    assert breach({**OK, "rel_l2": 0.02}, *limits) == "tolerance"
    assert breach({**OK, "rel_l2": 0.2}, *limits) == "rel_l2"
    assert breach({**OK, "max_abs": 0.5}, *limits) == "max_abs"
    assert breach({**OK, "cand_nonfinite": 1}, *limits) == "nonfinite"
    assert breach({**OK, "rel_l2": float("nan")}, *limits) == "nan_stat"


def test_arming_is_per_call_site() -> None:
    c = Captures()
    assert not c.wants(3)
    c.arm(3)
    c.arm(3)  # a second breach before the snapshot does not add tries
    assert c.wants(3) and not c.wants(4)
