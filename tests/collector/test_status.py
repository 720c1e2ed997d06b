"""The status page (GET /) and its charts: bounded on runs with many layers, honest about NaN statistics."""

from __future__ import annotations

import re
import time

from shadowd.collector.charts import DARK_RED, MAX_COLUMNS, MAX_ROWS, heatmap_svg
from tests.collector.helpers import post_msgpack, register
from tests.factories import make_batch, run_body


def _slot(layer: int, t: int, **over: float) -> dict[str, float]:
    row = {"layer": layer, "t": t, "n": 10, "n_exceed": 0, "n_cand_nonfinite": 0, "n_base_nonfinite": 0,
           "n_error": 0, "n_nan_stat": 0, "n_nan_unexplained": 0, "max_rel_l2": 1e-3, "sum_rel_l2": 1e-2}
    row.update(over)
    return row


def test_heatmap_of_many_layers_is_bounded() -> None:
    """A run may declare 100 000 layers: the heatmap merges adjacent layers instead of drawing a row each (5 000
    layers over 200 time buckets drew 505 000 cells, a 60 MB page)."""
    slots = [_slot(0, 60 * i) for i in range(200)] + [_slot(4321, 60 * 150, max_rel_l2=1.0)]
    svg = heatmap_svg(slots, 100_000, 1.6e-2)
    cells = svg.count("<rect") - 10  # less the legend
    assert cells <= MAX_ROWS * MAX_COLUMNS
    assert len(svg) < 5_000_000
    # the merged row holding layer 4321 still shows its worst cell
    assert re.search(rf'fill="{DARK_RED}"><title>layers \d+–\d+, ', svg)


def test_heatmap_of_few_layers_keeps_one_row_each() -> None:
    svg = heatmap_svg([_slot(lay, 0) for lay in range(61)], 61, 1.6e-2)
    assert svg.count("<title>layer ") == 61 and "layers " not in svg


def test_heatmap_marks_unexplained_nan_statistics() -> None:
    """A NaN statistic counts as exceeding and fails the tolerance criterion unless a non-finite output explains
    it: its cell is dark red, not coloured by the finite calls' largest rel-L2."""
    nan = heatmap_svg([_slot(0, 0, n_nan_stat=1, n_nan_unexplained=1)], 1, 1.6e-2)
    assert f'fill="{DARK_RED}"><title>layer 0' in nan and "NaN statistic" in nan
    explained = heatmap_svg([_slot(0, 0, n_nan_stat=1, n_base_nonfinite=1)], 1, 1.6e-2)
    assert f'fill="{DARK_RED}"><title>layer 0' not in explained


def test_status_page_of_a_run_declaring_many_layers(fresh_sqlite, make_client) -> None:
    client = make_client(fresh_sqlite, eval_interval_s=3600, ingest_writer="inline")
    run_id = register(client, run_body(num_layers=20_000))
    now = time.time()
    b = make_batch(300, num_layers=1, ts0=now - 300 * 60)
    b["samples"]["ts"] = [now - 300 * 60 + 60 * i for i in range(300)]
    assert post_msgpack(client, run_id, b).status_code == 200
    r = client.get(f"/?run_id={run_id}")
    assert r.status_code == 200
    assert len(r.content) < 5_000_000, f"{len(r.content)} bytes"


def test_status_page_shows_a_nan_statistic(fresh_sqlite, make_client) -> None:
    client = make_client(fresh_sqlite, eval_interval_s=3600, ingest_writer="inline")
    run_id = register(client, run_body(num_layers=2))
    b = make_batch(40, num_layers=2, ts0=time.time() - 60)
    b["samples"]["rel_l2"][0] = float("nan")  # layer 0; outputs finite on both sides
    assert post_msgpack(client, run_id, b).status_code == 200
    page = client.get(f"/?run_id={run_id}").text
    assert re.search(rf'fill="{DARK_RED}"><title>layer 0, [0-9:]+: non-finite or error, or NaN statistic', page)
    assert f'fill="{DARK_RED}"><title>layer 1' not in page


def _producer_rows(page: str) -> list[list[str]]:
    section = page.split('<section id="producers">', 1)[1].split("</section>", 1)[0]
    head = re.findall(r"<th[^>]*>([^<]*)</th>", section)
    rows = [re.findall(r"<td[^>]*>([^<]*)</td>", tr) for tr in section.split("<tr>")[2:]]
    return [head, *rows]


def test_the_producers_table_shows_the_pipeline_stage_only_in_runs_of_several_stages(fresh_sqlite,
                                                                                     make_client) -> None:
    client = make_client(fresh_sqlite, eval_interval_s=3600, ingest_writer="inline")
    plain = register(client, run_body(num_layers=2))
    assert post_msgpack(client, plain, make_batch(8, num_layers=2, producer="only")).status_code == 200
    head, *_ = _producer_rows(client.get(f"/?run_id={plain}").text)
    assert head[:2] == ["producer", "rank"]
    staged = register(client, {**run_body(num_layers=2), "run_key": "pp"})
    for stage, producer in ((0, "first"), (1, "second")):
        b = {**make_batch(8, num_layers=2, producer=producer), "stage": stage}
        assert post_msgpack(client, staged, b).status_code == 200
    head, *rows = _producer_rows(client.get(f"/?run_id={staged}").text)
    assert head[:3] == ["producer", "stage", "rank"]
    assert [r[:3] for r in rows] == [["first", "0", "0"], ["second", "1", "0"]]


def test_run_picker_shows_an_old_run_as_selected(fresh_sqlite, make_client) -> None:
    """The picker lists the 200 newest runs; the run shown is among its options (selected) even when older, else
    the form showed the newest run as chosen and "show" jumped to it."""
    client = make_client(fresh_sqlite, eval_interval_s=3600, ingest_writer="inline")
    first = register(client, run_body("the-old-one", num_layers=1))
    for i in range(200):
        register(client, run_body(f"r{i}", num_layers=1))
    page = client.get(f"/?run_id={first}").text
    assert re.search(rf'<option value="{first}" selected>{first} · the-old-one', page)
    assert page.count(" selected>") == 1


def test_status_page_through_a_database_outage(fresh_sqlite, make_client, monkeypatch) -> None:
    """The person watching the status page during a database outage gets a page that says so and reloads itself
    (503, Refresh and Retry-After), not the API's JSON error; the page is back once the database answers."""
    from sqlalchemy.exc import OperationalError

    from shadowd.collector import queries

    c = make_client(fresh_sqlite)
    run_id = register(c, run_body())
    assert post_msgpack(c, run_id, make_batch(8)).status_code == 200

    def down(*_a, **_k):
        raise OperationalError("SELECT 1", {}, ConnectionError("connection refused"))

    with monkeypatch.context() as m:
        m.setattr(queries, "list_runs", down)
        r = c.get("/")
        assert r.status_code == 503 and r.headers["content-type"].startswith("text/html")
        assert "The database is unavailable" in r.text and "ConnectionError" in r.text
        assert r.headers["refresh"] == r.headers["retry-after"] == "5"
        assert c.get(f"/v1/runs/{run_id}").status_code == 200  # (only the page's read was made to fail)
    r = c.get("/")
    assert r.status_code == 200 and "The database is unavailable" not in r.text
