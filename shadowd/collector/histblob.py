"""The stored form of a sample's |diff| histogram (``samples.hist``).

One byte ``w`` (1, 2, 4 or 8), then the HIST_BINS counts of shadowd.wire's log2 histogram, bin 0
first, as little-endian unsigned integers of ``w`` bytes. The collector picks, per batch, the
narrowest width that holds the batch's largest count: calls of up to 4 Gi elements take 161 bytes
instead of 320, small calls 81. Rows written before migration 0003 are HIST_BINS plain int64
(320 bytes, no width byte); :func:`decode` reads both.
"""

from __future__ import annotations

import numpy as np

from shadowd.wire import HIST_BINS

__all__ = ["LEGACY_SIZE", "decode", "encode_rows", "width_of"]

LEGACY_SIZE = HIST_BINS * 8  # the form before migration 0003


def width_of(top: int) -> int:
    """Bytes per count for counts up to ``top``."""
    for w in (1, 2, 4):
        if top < 1 << (8 * w):
            return w
    return 8


def encode_rows(hist: np.ndarray) -> np.ndarray:
    """Encode an (n, HIST_BINS) array of non-negative counts: an (n, 1 + HIST_BINS·w) uint8 array, a row each."""
    h = np.asarray(hist)
    w = width_of(int(h.max()) if h.size else 0)
    out = np.empty((h.shape[0], 1 + HIST_BINS * w), dtype=np.uint8)
    out[:, 0] = w
    out[:, 1:] = np.ascontiguousarray(h, dtype=f"<u{w}").view(np.uint8).reshape(h.shape[0], HIST_BINS * w)
    return out


def decode(blob: bytes) -> list[int]:
    """The HIST_BINS counts of one stored histogram (either form)."""
    if len(blob) == LEGACY_SIZE:
        return [int(x) for x in np.frombuffer(blob, dtype="<i8")]
    w = blob[0] if blob else 0
    if w not in (1, 2, 4, 8) or len(blob) != 1 + HIST_BINS * w:
        raise ValueError(f"not a stored histogram of {HIST_BINS} bins ({len(blob)} bytes)")
    return [int(x) for x in np.frombuffer(blob, dtype=f"<u{w}", offset=1)]
