"""The host control word that the captured control kernel reads in one load (layout and bounds)."""

from __future__ import annotations

import importlib.util
import itertools
from typing import Any

import pytest

# imported inside the tests, not at collection: Triton must not define kernels before tests/sglang's conftest
# has chosen its interpreter
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")


def _control() -> Any:
    from shadowd.hook import triton_control

    return triton_control


def _field(word: int, name: str) -> int:
    shift, bits = _control().HOST_WORD[name]
    return (word >> shift) & ((1 << bits) - 1)


def test_fields_round_trip_and_fit_a_signed_int64() -> None:
    pack = _control().pack_host_word
    w = pack(2, 7, 100, disabled=False, fallback=True)
    names = ("mode", "disabled", "fallback", "sample_n", "spot_n", "shapes")
    assert [_field(w, k) for k in names] == [2, 0, 1, 7, 100, 0]
    gated = pack(2, 7, 100, disabled=False, fallback=True, shapes=True)  # a promotion gate opened on a verdict
    assert [_field(gated, k) for k in names] == [2, 0, 1, 7, 100, 1]
    huge = pack(1, 2**62, 2**62, disabled=True, fallback=True, shapes=True)  # "never": clamped to the fields
    assert huge < 2**63 and _field(huge, "sample_n") == 2**30 - 1 and _field(huge, "spot_n") == 2**28 - 1
    assert _field(huge, "shapes") == 1
    fields = sorted(_control().HOST_WORD.values())
    # (the fields do not overlap, and the last leaves the sign bit alone)
    assert all(a + n <= b for (a, n), (b, _) in itertools.pairwise(fields)) and fields[-1][0] + fields[-1][1] <= 63
    assert _field(pack(1, 0, 0, disabled=False, fallback=False), "sample_n") == 1  # at least 1


def test_bad_mode_names_the_field() -> None:
    with pytest.raises(ValueError, match="mode"):
        _control().pack_host_word(3, 1, 1, disabled=False, fallback=False)
