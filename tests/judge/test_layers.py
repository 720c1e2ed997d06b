"""The per-layer readiness table (``GET /readiness/{id}/layers``) agrees with the verdict it sits beside: every layer
a criterion that did not pass names is marked in the table, with a line saying why."""

from __future__ import annotations

from typing import Any

from shadowd.judge.inputs import RunRollups
from shadowd.judge.layers import layer_table
from shadowd.judge.verdict import judge
from tests.judge.builders import SMALL, T0, cell, rollups

_RANK = {"ok": 0, "insufficient": 1, "fail": 2}


def _check_agrees(r: RunRollups) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
    report = judge(r, SMALL)
    rows = {row["layer"]: row for row in layer_table(r, SMALL)}
    for c in report["criteria"]:
        if c["status"] == "pass" or c["informational"]:
            continue
        need = "fail" if c["status"] == "fail" else "insufficient"
        for lay in c["layers"]:
            assert _RANK[rows[lay]["status"]] >= _RANK[need], (c["name"], rows[lay])
            assert c["name"] in rows[lay]["criteria"], (c["name"], rows[lay])
    for lay in report["failing_layers"]:
        assert rows[lay]["status"] != "ok" and rows[lay]["problems"], rows[lay]
    return report, rows


def test_a_bucket_beyond_tolerance_in_a_layer_within_it_on_average() -> None:
    """Tolerance is judged per (layer, shape bucket): layer 0's small bucket fails it while the layer's mean does
    not; the table said layer 0 was ok."""
    cells = [cell(0, 1000), cell(0, 20, rel=0.05, bucket=(16, 8, 13, 8)), cell(1, 1000)]
    report, rows = _check_agrees(rollups(cells=cells))
    assert report["verdict"] == "NOT_READY" and report["failing_layers"] == [0]
    assert rows[0]["status"] == "fail" and any("bs16-t8-p13-h8" in x for x in rows[0]["problems"])
    assert rows[1]["status"] == "ok"


def test_unexplained_nan_statistics_mark_the_layer() -> None:
    cells = [cell(0, 1000, n_nan_stat=3, n_nan_unexplained=3), cell(1, 1000)]
    report, rows = _check_agrees(rollups(cells=cells))
    assert report["failing_layers"] == [0]
    assert rows[0]["status"] == "fail" and any("NaN" in x for x in rows[0]["problems"]), rows[0]
    explained = [cell(0, 1000, n_nan_stat=3, n_base_nonfinite=3), cell(1, 1000)]
    _, rows = _check_agrees(rollups(cells=explained))
    assert rows[0]["status"] == "ok", rows[0]


def test_drift_of_max_abs_over_scale_marks_the_layer() -> None:
    """The drift criterion compares rel-L2, cosine difference and max-abs / scale per layer; the table compared
    rel-L2 alone."""
    r = rollups()
    for s in r.slots:
        if s["layer"] == 1 and s["t"] > T0:
            s["sum_scaled"] *= 10  # max-abs / scale ten times its history in layer 1; rel-L2 unchanged
    report, rows = _check_agrees(r)
    assert report["failing_layers"] == [1]
    assert rows[1]["status"] == "fail" and any("scaled_max_abs" in x for x in rows[1]["problems"]), rows[1]
    assert rows[0]["status"] == "ok"


def test_oracle_failure_marks_the_layer() -> None:
    r = rollups()
    r.hists[(1, "oracle_ratio")] = {40: 100}  # median far above k
    report, rows = _check_agrees(r)
    assert 1 in report["failing_layers"]
    assert rows[1]["status"] == "fail"


def test_passing_run_has_every_layer_ok() -> None:
    report, rows = _check_agrees(rollups(num_layers=3))
    assert report["raw_verdict"] == "READY"
    assert all(row["status"] == "ok" and row["criteria"] == [] for row in rows.values())
