"""The shapes on mode may serve the candidate on: those the promotion gate's READY verdict covered.

A verdict speaks for the shapes its validate run saw, in the collector's shape buckets (``covered_shapes`` of a
readiness report: ``[batch bucket, tree bucket, prefix bucket]``, each bucket met ``min_cell_samples`` in every
layer). A call outside them — a first 200k-token prefix, a tree size never seen, a batch larger than any compared
— was never evidence for the candidate, so on mode serves it by the baseline (and shadows it as validate does).

A call's shape indices are the buckets' own: ``ceil(log2(batch size))`` and ``ceil(log2(tree size))`` (the
collector's power-of-two buckets), and ``bit_length(prefix length)`` (``shadowd.wire.prefix_bucket_of``).
:meth:`Coverage.bitmap` lays the set out for the control kernel, which checks every call under a CUDA graph:
word ``batch index · 32 + tree index``, bit ``prefix index`` (:data:`WORDS` int64 words; all ones until a gate
opens on a verdict).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from shadowd.wire import prefix_bucket_of

__all__ = ["BATCH_IDX_MAX", "PREFIX_IDX_MAX", "WORDS", "Coverage", "shape_index"]

#: batch and tree indices go to 31 (a bucket of 2^31; the wire caps both at 2^30), prefix indices to 63
BATCH_IDX_MAX = 31
PREFIX_IDX_MAX = 63
#: int64 words of the device bitmap
WORDS = (BATCH_IDX_MAX + 1) * 32


def shape_index(batch_size: int, draft_tokens: int, prefix_len: int) -> tuple[int, int, int]:
    """(batch, tree, prefix) bucket indices of one call: the collector's buckets 2^b, 2^t and prefix bucket p."""
    b = min((max(int(batch_size), 1) - 1).bit_length(), BATCH_IDX_MAX)
    t = min((max(int(draft_tokens), 1) - 1).bit_length(), BATCH_IDX_MAX)
    p = prefix_bucket_of(min(max(int(prefix_len), 0), 2**52))  # (the control kernel's float64 is exact to 2^53)
    return b, t, p


def _index_of_bucket(value: Any, field: str) -> int:
    # a power-of-two bucket (batch, tree) as its index
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value & (value - 1):
        raise ValueError(f"covered_shapes: {field} {value!r} is not a power-of-two bucket")
    return min(value.bit_length() - 1, BATCH_IDX_MAX)


@dataclass(frozen=True)
class Coverage:
    """A set of covered shape indices (:func:`shape_index`)."""

    shapes: frozenset[tuple[int, int, int]]

    @classmethod
    def from_report(cls, report: Mapping[str, Any]) -> Coverage:
        """The shapes of a readiness report's ``covered_shapes``; ValueError naming what is wrong (a report
        without them was judged by a collector that did not say which shapes it covers)."""
        rows = report.get("covered_shapes")
        if not isinstance(rows, list):
            raise ValueError("covered_shapes: the verdict does not say which shapes it covers (a collector older "
                             "than this hook?)")
        return cls.from_buckets(rows)

    @classmethod
    def from_buckets(cls, rows: Iterable[Any]) -> Coverage:
        """From ``[batch bucket, tree bucket, prefix bucket]`` rows (the collector's bucket values)."""
        shapes = set()
        for row in rows:
            if not isinstance(row, (list, tuple)) or len(row) != 3:
                raise ValueError(f"covered_shapes: {row!r} is not [batch bucket, tree bucket, prefix bucket]")
            bs, t, p = row
            if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p <= PREFIX_IDX_MAX:
                raise ValueError(f"covered_shapes: prefix bucket {p!r} is not in [0, {PREFIX_IDX_MAX}]")
            shapes.add((_index_of_bucket(bs, "batch bucket"), _index_of_bucket(t, "tree bucket"), p))
        return cls(frozenset(shapes))

    def union(self, other: Coverage) -> Coverage:
        """The shapes covered by either set."""
        return Coverage(self.shapes | other.shapes)

    def covers(self, batch_size: int, draft_tokens: int, prefix_len: int) -> bool:
        """Whether a call of this shape lies in a covered bucket."""
        return shape_index(batch_size, draft_tokens, prefix_len) in self.shapes

    def bitmap(self) -> list[int]:
        """The control kernel's layout (module docstring): :data:`WORDS` int64 values."""
        words = [0] * WORDS
        for b, t, p in self.shapes:
            words[b * 32 + t] |= 1 << p
        return [w - (1 << 64) if w >= 1 << 63 else w for w in words]  # (as signed int64)

    def describe(self) -> str:
        """A short summary for logs: how many buckets, the largest tree and prefix covered."""
        if not self.shapes:
            return "no shape bucket"
        t_max = max(t for _, t, _ in self.shapes)
        p_max = max(p for _, _, p in self.shapes)
        return (f"{len(self.shapes)} shape buckets (trees up to {1 << t_max} nodes, prefixes below "
                f"{1 << p_max} tokens)")
