"""The status page's inline SVG charts: the per-layer heatmap and exceedance over time.

Pure functions of the rollup slots that ``routers.status`` reads (dicts with ``t``, ``layer``, ``n``,
``n_exceed``, ``n_cand_nonfinite``, ``n_base_nonfinite``, ``n_error``, ``n_nan_unexplained`` and ``max_rel_l2``); no
database, no web framework.
"""

from __future__ import annotations

import datetime as dt
import itertools
import math
from collections import defaultdict
from typing import Any

__all__ = ["DARK_RED", "EMPTY", "MAX_COLUMNS", "MAX_ROWS", "exceedance_svg", "heatmap_svg", "short_time"]

#: most time columns drawn (adjacent rollup time buckets are merged above this)
MAX_COLUMNS = 120
#: most layer rows drawn (adjacent layers are merged above this: a run may declare 100 000 layers)
MAX_ROWS = 128
#: colour stops over log2(max rel-L2 / tolerance) from -8 to 0: green up to tol/4, yellow at tol/2,
#: red at tol; above the tolerance, non-finite or failed: DARK_RED
_STOPS = ((0.0, (237, 247, 237)), (0.75, (129, 199, 132)), (0.875, (255, 213, 79)), (1.0, (229, 57, 53)))
DARK_RED = "#6d0000"
EMPTY = "#eceff1"


def _columns(slots: list[dict[str, Any]]) -> tuple[list[int], dict[int, int]]:
    """Distinct slot starts and the column each falls in (at most MAX_COLUMNS columns)."""
    starts = sorted({int(s["t"]) for s in slots})
    if not starts:
        return [], {}
    per = max(1, math.ceil(len(starts) / MAX_COLUMNS))
    col_of = {ts: i // per for i, ts in enumerate(starts)}
    firsts = [starts[i] for i in range(0, len(starts), per)]
    return firsts, col_of


def _colour(ratio: float) -> str:
    if not math.isfinite(ratio) or ratio > 1.0:
        return DARK_RED
    pos = 0.0 if ratio <= 0 else min(1.0, max(0.0, (math.log2(ratio) + 8.0) / 8.0))
    for (p0, c0), (p1, c1) in itertools.pairwise(_STOPS):
        if pos <= p1:
            f = (pos - p0) / (p1 - p0)
            r, g, b = (round(a + (z - a) * f) for a, z in zip(c0, c1, strict=True))
            return f"#{r:02x}{g:02x}{b:02x}"
    return DARK_RED


def short_time(ts: float) -> str:
    """HH:MM (UTC) of a unix time: the charts' axis labels."""
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%H:%M")


def _flagged(s: dict[str, Any]) -> bool:
    """A slot with a candidate-only non-finite call, a candidate error, or NaN statistics that neither explains
    (the tolerance criterion's unexplained NaN): drawn dark red whatever its largest rel-L2."""
    return bool(s.get("n_cand_nonfinite") or s.get("n_error") or s.get("n_nan_unexplained"))


def heatmap_svg(slots: list[dict[str, Any]], num_layers: int, tolerance: float) -> str:
    """Layers (rows) × time (columns); colour = largest per-call rel-L2 relative to the tolerance.

    At most MAX_ROWS rows and MAX_COLUMNS columns: adjacent layers (time buckets) share a row (column) above
    that, and a merged cell shows its worst."""
    firsts, col_of = _columns(slots)
    if not firsts:
        return '<p class="muted">no samples yet</p>'
    layers = sorted({int(s["layer"]) for s in slots} | set(range(num_layers)))
    per_row = max(1, math.ceil(len(layers) / MAX_ROWS))
    rows = [(layers[i], layers[min(i + per_row, len(layers)) - 1]) for i in range(0, len(layers), per_row)]
    row_of = {lay: i // per_row for i, lay in enumerate(layers)}
    cell: dict[tuple[int, int], float] = defaultdict(float)
    for s in slots:
        key = (row_of[int(s["layer"])], col_of[int(s["t"])])
        worst = float("inf") if _flagged(s) else float(s["max_rel_l2"] or 0.0) / tolerance
        cell[key] = max(cell[key], worst)
    left, top, plot_w = 46, 8, 900
    cw = plot_w / len(firsts)
    rh = max(3.0, min(16.0, 420.0 / len(rows)))
    height = top + rh * len(rows) + 58
    out = [
        f'<svg id="heatmap" role="img" aria-label="per-layer heatmap" xmlns="http://www.w3.org/2000/svg" '
        f'width="{left + plot_w + 10}" height="{height:.0f}">'
    ]
    for row, (first, last) in enumerate(rows):
        y = top + row * rh
        name = f"layer {first}" if first == last else f"layers {first}–{last}"
        if len(rows) <= 32 or row % max(1, len(rows) // 16) == 0:
            out.append(f'<text x="{left - 6}" y="{y + rh * 0.8:.1f}" text-anchor="end">L{first}</text>')
        for col in range(len(firsts)):
            v = cell.get((row, col))
            fill = EMPTY if v is None else _colour(v)
            title = (
                "no samples"
                if v is None
                else ("non-finite or error, or NaN statistic" if math.isinf(v)
                      else f"max rel-L2 = {v:.3g} × tolerance")
            )
            out.append(
                f'<rect x="{left + col * cw:.1f}" y="{y:.1f}" width="{max(cw - 0.5, 0.5):.1f}" '
                f'height="{max(rh - 0.5, 0.5):.1f}" fill="{fill}"><title>{name}, '
                f"{short_time(firsts[col])}: {title}</title></rect>"
            )
    base = top + rh * len(rows)
    out.append(f'<text x="{left}" y="{base + 14:.0f}">{short_time(firsts[0])}</text>')
    out.append(
        f'<text x="{left + plot_w}" y="{base + 14:.0f}" text-anchor="end">{short_time(firsts[-1])} UTC</text>'
    )
    # legend: tolerance/256 .. tolerance, then above tolerance / non-finite
    ly = base + 26
    for i in range(9):
        ratio = 2.0 ** (i - 8)
        out.append(f'<rect x="{left + i * 28}" y="{ly}" width="28" height="10" fill="{_colour(ratio)}"/>')
    out.append(f'<rect x="{left + 9 * 28 + 6}" y="{ly}" width="28" height="10" fill="{DARK_RED}"/>')
    out.append(f'<text x="{left}" y="{ly + 24}">tol/256</text>')
    out.append(f'<text x="{left + 8 * 28 + 14}" y="{ly + 24}" text-anchor="middle">tol</text>')
    out.append(
        f'<text x="{left + 10 * 28 + 14}" y="{ly + 24}">&gt; tol, non-finite or error, or NaN statistic '
        f"(tol = rel-L2 {tolerance:.3g})</text>"
    )
    out.append("</svg>")
    return "".join(out)


def exceedance_svg(slots: list[dict[str, Any]]) -> str:
    """Share of calls beyond tolerance per time column (line), non-finite calls (red bars)."""
    firsts, col_of = _columns(slots)
    if not firsts:
        return '<p class="muted">no samples yet</p>'
    n = [0] * len(firsts)
    exc = [0] * len(firsts)
    nonfinite = [0] * len(firsts)
    for s in slots:
        col = col_of[int(s["t"])]
        n[col] += int(s["n"])
        exc[col] += int(s["n_exceed"])
        nonfinite[col] += int(s["n_cand_nonfinite"])
    rate = [e / k if k else 0.0 for e, k in zip(exc, n, strict=True)]
    top_rate = max(max(rate), 1e-3)
    left, top, plot_w, plot_h = 58, 10, 890, 140
    cw = plot_w / len(firsts)
    out = [
        f'<svg id="exceedance" role="img" aria-label="exceedance over time" '
        f'xmlns="http://www.w3.org/2000/svg" width="{left + plot_w + 10}" height="{top + plot_h + 40}">',
        f'<line x1="{left}" y1="{top + plot_h}" x2="{left + plot_w}" y2="{top + plot_h}" stroke="#9aa5b1"/>',
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + plot_h}" stroke="#9aa5b1"/>',
        f'<text x="{left - 4}" y="{top + 8}" text-anchor="end">{top_rate:.2%}</text>',
        f'<text x="{left - 4}" y="{top + plot_h}" text-anchor="end">0</text>',
    ]
    top_nf = max(nonfinite) or 1
    for col, k in enumerate(nonfinite):
        if k:
            h = max(3.0, plot_h * 0.5 * k / top_nf)
            out.append(
                f'<rect x="{left + col * cw:.1f}" y="{top + plot_h - h:.1f}" width="{max(cw - 1, 1):.1f}" '
                f'height="{h:.1f}" fill="#c62828" opacity="0.8"><title>{short_time(firsts[col])}: {k} '
                f"non-finite mismatches</title></rect>"
            )
    pts = " ".join(
        f"{left + (col + 0.5) * cw:.1f},{top + plot_h - plot_h * r / top_rate:.1f}"
        for col, r in enumerate(rate)
    )
    out.append(f'<polyline points="{pts}" fill="none" stroke="#1565c0" stroke-width="1.6"/>')
    for col, r in enumerate(rate):
        if exc[col]:
            out.append(
                f'<circle cx="{left + (col + 0.5) * cw:.1f}" cy="{top + plot_h - plot_h * r / top_rate:.1f}" '
                f'r="2.2" fill="#1565c0"><title>{short_time(firsts[col])}: {exc[col]} of {n[col]} calls '
                f"beyond tolerance ({r:.3%})</title></circle>"
            )
    out.append(f'<text x="{left}" y="{top + plot_h + 14}">{short_time(firsts[0])}</text>')
    out.append(
        f'<text x="{left + plot_w}" y="{top + plot_h + 14}" text-anchor="end">{short_time(firsts[-1])} UTC</text>'
    )
    out.append(
        f'<text x="{left}" y="{top + plot_h + 32}">blue: share of calls beyond tolerance · red bars: calls '
        f"non-finite in the candidate only</text>"
    )
    out.append("</svg>")
    return "".join(out)
