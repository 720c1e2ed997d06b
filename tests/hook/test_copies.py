"""The candidate's private input copies under graph capture (``shadowd.hook.copies``), on CPU tensors."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shadowd.hook import copies
from shadowd.hook.copies import PIECE_BYTES, clone_many


def _inputs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    k = torch.randn(7, 1, 576, generator=g).to(torch.bfloat16)
    return [torch.randn(7, 8, 576, generator=g).to(torch.bfloat16),  # q
            k, k[..., :512],  # the draft k and its v view
            torch.randint(0, 1 << 30, (70_000,), dtype=torch.int32, generator=g),  # 280 KB of indices: 5 pieces
            torch.rand(37, generator=g) < 0.5,  # an odd-length byte mask
            torch.arange(9, dtype=torch.int64),  # pointers
            torch.empty(0, 576),
            torch.arange(64, dtype=torch.int32)[5:50],  # a view at a word offset
            torch.arange(64, dtype=torch.uint8)[3:35],  # a byte view off the word
            torch.randn(6, 10, generator=g)[:, ::2]]  # a strided view of nothing in the list


def test_copies_are_equal_and_private() -> None:
    xs = _inputs()
    before = [x.clone() for x in xs]
    ys = clone_many(xs)
    for x, y, b in zip(xs, ys, before, strict=True):
        assert y.dtype == x.dtype and y.shape == x.shape and torch.equal(y, b)
        if x.numel():
            assert y.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    for y in ys:  # writing every copy leaves every input as it was
        y.fill_(True) if y.dtype == torch.bool else y.zero_()
    assert all(torch.equal(x, b) for x, b in zip(xs, before, strict=True))


def test_a_view_of_a_copied_input_is_the_same_view_of_its_copy() -> None:
    xs = _inputs()
    ys = clone_many(xs)
    k2, v2 = ys[1], ys[2]
    assert v2.untyped_storage().data_ptr() == k2.untyped_storage().data_ptr(), "v stays a view of k's copy"
    assert v2.stride() == xs[2].stride() and v2.storage_offset() == k2.storage_offset()
    k2[0, 0, 3] = 42.0
    assert float(v2[0, 0, 3]) == 42.0
    strided = ys[-1]  # its base is not in the list: a clone of its own
    assert torch.equal(strided, xs[-1]) and strided.is_contiguous()


def test_one_foreach_copies_every_word_sized_input_in_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = torch._foreach_copy_

    def counting(dsts: Any, srcs: Any) -> Any:
        calls.append(len(srcs))
        assert all(s.numel() * 4 <= PIECE_BYTES and s.dtype == torch.int32 for s in srcs)
        return real(dsts, srcs)

    monkeypatch.setattr(copies.torch, "_foreach_copy_", counting)
    clone_many(_inputs())
    # q (64,512 B: 1 piece), k (1), the indices (280 KB: 5), the pointers (1), the word-offset view (1)
    assert calls == [9]


def test_nothing_to_copy() -> None:
    assert clone_many([]) == []
    (e,) = clone_many([torch.empty(0, dtype=torch.int32)])
    assert e.numel() == 0 and e.dtype == torch.int32
