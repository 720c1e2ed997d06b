"""The shapes a verdict covers, as the hook reads them (``shadowd.hook.coverage``)."""

from __future__ import annotations

import numpy as np
import pytest

from shadowd.hook.coverage import WORDS, Coverage, shape_index
from shadowd.wire import prefix_bucket_of


def collector_buckets(bs: int, t: int, prefix: int) -> tuple[int, int, int]:
    """The collector's buckets of one sample (shadowd.collector.rollups: power-of-two ceilings, prefix bit length)."""
    ceil = np.left_shift(1, np.ceil(np.log2(np.maximum(np.array([bs, t]), 1))).astype(np.int64))
    return int(ceil[0]), int(ceil[1]), prefix_bucket_of(prefix)


@pytest.mark.parametrize("bs", [1, 3, 32, 33, 2**30])
@pytest.mark.parametrize("t", [1, 9, 16, 257, 2**30])
@pytest.mark.parametrize("prefix", [0, 1, 4095, 4096, 200_000, 2**40])
def test_a_call_is_covered_by_the_bucket_the_collector_files_it_under(bs: int, t: int, prefix: int) -> None:
    cov = Coverage.from_buckets([list(collector_buckets(bs, t, prefix))])
    assert cov.covers(bs, t, prefix)
    assert not cov.covers(bs * 2, t, prefix) and not cov.covers(bs, t * 2, prefix)
    assert not cov.covers(bs, t, 2 * prefix + 1)


def test_the_bitmap_holds_one_bit_per_covered_bucket() -> None:
    cov = Coverage.from_buckets([[1, 16, 13], [1, 16, 63], [64, 512, 0]])
    words = cov.bitmap()
    assert len(words) == WORDS
    b, t, p = shape_index(1, 16, 5000)
    assert (b, t, p) == (0, 4, 13) and words[b * 32 + t] == (1 << 13) - (1 << 63)  # bit 63: a negative int64
    assert words[6 * 32 + 9] == 1
    assert sum(bin(w & (2**64 - 1)).count("1") for w in words) == 3
    assert "3 shape buckets (trees up to 512 nodes, prefixes below" in cov.describe()


@pytest.mark.parametrize("rows, field", [
    ([[3, 16, 13]], "batch bucket 3"), ([[1, 0, 13]], "tree bucket 0"), ([[1, 16, 64]], "prefix bucket 64"),
    ([[1, 16]], "is not [batch bucket"), (["bs1-t16-p13"], "is not [batch bucket"), ([[True, 16, 1]], "batch bucket"),
])
def test_a_malformed_shape_is_refused_naming_it(rows: list, field: str) -> None:
    with pytest.raises(ValueError, match=field.replace("[", r"\[")):
        Coverage.from_buckets(rows)


def test_a_report_without_shapes_says_so() -> None:
    with pytest.raises(ValueError, match="covered_shapes: the verdict does not say"):
        Coverage.from_report({"verdict": "READY"})
    assert Coverage.from_report({"covered_shapes": []}).shapes == frozenset()
