"""The Triton kernels and the device path's decisions on the CPU, through TRITON_INTERPRET=1.

The scenario (``interp_scenario.py``) runs in a subprocess (the interpreter is chosen when kernels are defined),
once per test session (``conftest.py``'s ``interp_run``; ``test_kernels_build.py`` compiles the launches it made).
CUDA-only calls are stood in for (pinned memory → plain tensors, one fake device); the system fence and timers are
compiled out (GPU/USE_TIMER), everything else — statistics, ring records, sampling, spot checks, the sticky
fallback and the kill switch word — is the kernels' own code. Skipped when Triton is not installed.
"""

from __future__ import annotations

import math
from typing import Any

import pytest


def test_kernels_and_device_decisions_in_the_interpreter(interp_run: dict[str, Any]) -> None:
    r = interp_run["result"]
    assert r["stats_close"] and r["hist_equal"], r
    assert r["max_pos"][0] == r["max_pos"][1]
    assert r["fast_path_equal"] == [True] * 4, "all-finite outputs (fast path), max position included"
    assert math.isfinite(r["zero_base"][1]) and math.isclose(*r["zero_base"], rel_tol=1e-6), r["zero_base"]
    assert r["eager_steps"] == [2, 4] and r["eager_numel"] == 12 * 8 and r["eager_bucket"] == [2, 16, 300, 4]
    assert r["eager_max_abs_ok"]
    assert r["device_steps"] == [6, 8], "sampling decided by the control kernel: every 2nd step"
    assert r["kill_switch_records"] == 0, "the pinned kill-switch word stops the statistics"
    assert r["empty_batch_records"] == 0, "an all-padding replay publishes no sample"
    assert r["after_empty_batch"] == [[2, 12 * 8]], r["after_empty_batch"]
    # calls 1..6 = steps 1..6, spot checks at 2, 4, 6; the candidate turns bad at call 4 (a spot check)
    assert r["on_outputs"] == ["cand", "cand", "cand", "base", "base", "base"] and r["fallback"]
    assert r["between_spot_outputs"] == ["cand", "cand", "base", "base", "base", "base"], r
    assert r["between_spot_records"] == [2, 3], "the spot check (step 2) and the hard failure (step 3) are reported"
    # gated on mode: the baseline does real work only on spot checks (steps 2, 4) and after the fallback;
    # a candidate going bad between spot checks (step 3) is served until the next spot check catches it
    assert r["gated_sizes_seen"] == [0, 5, 0, 5, 5, 5], r
    assert r["gated_outputs"] == ["cand", "cand", "cand", "base", "base", "base"], r
    assert r["gated_records"][:2] == [2, 4], r
    # validate with a candidate gate: the candidate works on sampled replays only (1 in 2), does nothing
    # after the kill switch, and its real inputs are never touched; the baseline's result is returned
    cg = r["cand_gate"]
    assert sorted(cg["sizes"][:4]) == [0, 0, 7, 7] and cg["sizes"][4:] == [0, 0], cg
    assert cg["records"] == 2 and cg["after_kill_records"] == 0, cg
    assert all(cg["baseline_returned"]) and cg["nsz_untouched"], cg
    # oracle sampling on the device path: 4 samples (the oracle's records are not samples), the 2nd and 4th
    # carrying exactly max |side - oracle| over the 96 real elements
    o = r["oracle"]
    assert all(o["returned"]) and o["n"] == 4 and o["errors"] == {}, o
    assert o["cand"][0] is None and o["cand"][2] is None and o["base"][0] is None, o
    assert o["cand"][1] == o["cand"][3] == o["cand_ref"] > 0, o
    assert o["base"][1] == o["base"][3] == o["base_ref"] > 0, o
    # the hook's own failures: the baseline served, the candidate disabled with the reason; the baseline's own
    # exception reaches the caller unchanged (and disables nothing); a failing gate leaves one ungated baseline run
    hf = r["hook_failure"]
    assert hf["returned"] and hf["after"] and hf["disabled"] and "launch failed" in hf["reason"], hf
    assert hf["samples"] == ["hook:RuntimeError"], "one sample tells the collector"
    assert r["baseline_error"] == "baseline says no" and not r["baseline_error_disabled"], r
    assert r["gate_failure"] == {"returned": True, "disabled": True, "base_calls": 1}, r["gate_failure"]
    assert r["push_race"] == {"first": True, "writer_finished": True, "dirty": False, "mirror_is_word": True,
                              "mode": 0}, r["push_race"]
    fv = r["flag_validate"]
    assert fv["returned"] == [True] * 4 and fv["errors"] == [None, None, "candidate_flag:0x4"], fv
    assert fv["disabled"] and "bits 4" in fv["reason"] and fv["cand_calls"] == 3 and fv["device_errors"] == 1, fv
    fo = r["flag_on"]
    assert fo["outputs"] == ["cand", "cand", "base", "base"], fo
    assert fo["fallback"] and "error flag" in fo["reason"] and fo["disabled"], fo
    # the first call is checked (the site has not seen its output's shape yet: eager, the host decides), step 2 is
    # a spot check on the device, and the hard failure of step 3 (its word raised) is published
    assert fo["errors"] == [None, None, "candidate_flag:0x1"], fo
    fg = r["flag_gated"]
    assert fg["outputs"] == ["cand", "cand", "cand", "base", "base", "base"], fg
    # (the first, eager call is checked: a full baseline run; then the gated baseline idles until the raised word)
    assert fg["sizes"] == [5, 0, 0, 5, 5, 5], "the gated baseline works from the replay after the raised word on"
    assert fg["fallback"] and "error flag" in fg["reason"] and fg["errors"] == [None, "candidate_flag:0x2"], fg
    fe = r["flag_eager_on"]
    assert fe["outputs"] == ["cand", "cand", "cand", "base", "base"] and fe["cand_calls"] == 3, fe
    assert fe["fallback"] and "error flag" in fe["reason"] and fe["disabled"] and fe["device_errors"] == 1, fe
    ng = r["nan_gated"]  # the third call's NaN is served (unchecked); the fourth is a spot check that catches it
    assert ng["outputs"] == ["cand", "cand", "nan", "base", "base", "base"], ng
    # (the first, eager call: checked, a full baseline run and a clean record)
    assert ng["sizes"] == [5, 0, 0, 5, 5, 5] and ng["fallback"] and ng["records"] == [[0, 0], [1, 0]], ng
    nl = r["nan_legit"]  # NaN from call 3 on, on both sides: checks at calls 4 and 6 (each after an unchecked NaN)
    assert nl["outputs"] == ["cand", "cand", "nan", "nan", "nan", "nan", "nan"] and not nl["fallback"], nl
    assert nl["sizes"] == [5, 0, 0, 5, 0, 5, 0] and nl["records"] == [[0, 0], [0, 1], [0, 1]], nl
    npad = r["nan_padded"]
    assert npad["outputs"] == ["cand"] * 6 and npad["sizes"] == [5] + [0] * 5, npad
    assert not npad["fallback"] and npad["records"] == [[0, 0]], npad
    nw = r["nan_word_eager"]  # steps 3 and 4 served the NaN (4 saw the word); step 5, checked whole, caught it
    assert nw["outputs"] == ["cand", "cand", "nan", "nan", "base", "base"], nw
    assert nw["fallback"] and not nw["disabled"] and nw["records"] == [[0, None], [1, None]], nw
    assert nw["word"] == [0, 1], "the word the checked call raised again stays for the next eager step"
    assert r["slot_eager"] == {"made": True, "unchecked": True, "l0": True}, r["slot_eager"]
    # on mode with both gates: one launch makes both copies per replay; the candidate idles while the kill switch
    # (steps 4-5) or the fall-back (from step 9) has the baseline serve, and works on every other replay
    bg = r["both_gates"]
    assert bg["launches"] == [[]] + [[2]] * 9, bg
    assert bg["outputs"] == ["cand", "cand", "cand", "base", "base", "cand", "cand", "base", "base", "base"], bg
    assert bg["cand_sizes"] == [7, 7, 7, 0, 0, 7, 7, 7, 0, 0], bg
    assert bg["base_sizes"] == [5, 5, 0, 5, 5, 5, 0, 5, 5, 5] and bg["fallback"], bg
    # on mode serves the candidate only on the verdict's shapes: prefixes 256-511 with trees of 9-16 nodes and
    # batches of two; 600 tokens (bucket 10), 255 (bucket 8) and a batch of three are served by the baseline
    cv = r["coverage"]
    assert cv["outputs"] == ["cand", "base", "cand", "cand", "base", "base", "cand"] and not cv["fallback"], cv
    assert cv["widened"] == 1 and cv["bitmap_word"] == (1 << 9) | (1 << 10), cv
    # counted: the first (eager) call by the host; the replays by the control kernel, reaching the host in the
    # records (the last one drained, an uncovered call's sample, carries 3 covered and 3 uncovered replays; the
    # widened replay after it, covered and no spot check, publishes nothing)
    assert cv["on_calls"] == [1, 0] and cv["device_on_calls"] == [3, 3], cv
    assert cv["stats"] == {"on_covered_calls": 4, "on_uncovered_calls": 3}, cv
    fc = r["first_call_captured"]
    assert fc["returned"] and fc["disabled"] and "during graph capture" in fc["reason"] and not fc["device"], fc


def test_histogram_scheme_falls_back_where_its_shared_memory_does_not_fit() -> None:
    """A tile with more warps than a shared-memory histogram is compiled for gets warp ballots, never a
    kernel that cannot compile (the columns need 4·40·threads bytes of static shared memory, ≤ 48 KiB)."""
    pytest.importorskip("triton")
    from shadowd.hook.device import hist_mode_for

    assert hist_mode_for(3, 8) == 3 and hist_mode_for(3, 4) == 3  # columns fit up to 8 warps
    assert hist_mode_for(3, 16) == 2  # 80 KiB of columns: ballots instead
    assert hist_mode_for(4, 8) == 4 and hist_mode_for(4, 16) == 2  # exponent rows: compiled as the columns are
    assert hist_mode_for(1, 16) == 1 and hist_mode_for(2, 16) == 2 and hist_mode_for(0, 8) == 0
