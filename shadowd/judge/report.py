"""The judge's report: verdicts, criteria and their JSON form.

A criterion has one of three outcomes: ``pass``, ``fail`` (turns the verdict NOT_READY) or
``insufficient`` (not enough evidence yet: INSUFFICIENT_DATA unless something failed).
Informational criteria (the baseline's own non-finite events) always pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "FAIL",
    "INSUFFICIENT",
    "INSUFFICIENT_DATA",
    "NOT_READY",
    "PASS",
    "READY",
    "VERDICTS",
    "Criterion",
    "bucket_label",
    "combine",
    "jsonable",
]

READY = "READY"
NOT_READY = "NOT_READY"
INSUFFICIENT_DATA = "INSUFFICIENT_DATA"
VERDICTS = (READY, NOT_READY, INSUFFICIENT_DATA)

PASS = "pass"
FAIL = "fail"
INSUFFICIENT = "insufficient"


def bucket_label(cell: dict[str, Any]) -> str:
    """A shape bucket as one string: ``bs<B>-t<T>-p<P>-h<H>`` (batch ≤ B, tree ≤ T, prefix < 2^P, H heads)."""
    return f"bs{cell['bs_bucket']}-t{cell['t_bucket']}-p{cell['prefix_bucket']}-h{cell['heads']}"


@dataclass
class Criterion:
    """One criterion's outcome, with what was observed and what was required."""

    name: str
    status: str
    observed: Any
    threshold: Any
    detail: str
    layers: list[int] = field(default_factory=list)
    buckets: list[str] = field(default_factory=list)
    conservative: bool = False
    informational: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.status == PASS

    def reason(self) -> str:
        """One human-readable line for a criterion that did not pass."""
        where = ""
        if self.layers:
            shown = ", ".join(str(x) for x in self.layers[:12])
            more = f" and {len(self.layers) - 12} more" if len(self.layers) > 12 else ""
            where += f" [layers {shown}{more}]"
        if self.buckets:
            shown = ", ".join(self.buckets[:6])
            more = f" and {len(self.buckets) - 6} more" if len(self.buckets) > 6 else ""
            where += f" [buckets {shown}{more}]"
        tag = "FAIL" if self.status == FAIL else "NEED MORE DATA"
        return f"{self.name}: {tag}: {self.detail}{where}"

    def to_dict(self) -> dict[str, Any]:
        return jsonable({
            "name": self.name,
            "status": self.status,
            "passed": self.passed,
            "observed": self.observed,
            "threshold": self.threshold,
            "detail": self.detail,
            "layers": self.layers,
            "buckets": self.buckets,
            "conservative": self.conservative,
            "informational": self.informational,
            **self.extra,
        })


def combine(criteria: list[Criterion]) -> str:
    """NOT_READY if any criterion failed, else INSUFFICIENT_DATA if any lacks data, else READY."""
    statuses = {c.status for c in criteria}
    if FAIL in statuses:
        return NOT_READY
    if INSUFFICIENT in statuses:
        return INSUFFICIENT_DATA
    return READY


def jsonable(x: Any) -> Any:
    """``x`` with non-finite floats spelled as strings ("NaN", "Infinity") so that JSON stays valid."""
    if isinstance(x, float):
        if math.isnan(x):
            return "NaN"
        if math.isinf(x):
            return "Infinity" if x > 0 else "-Infinity"
        return x
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [jsonable(v) for v in x]
    return x
