"""The arguments and outputs of a shadowed call, as the hook sees them.

* the tensors inside a call's arguments, nested list / tuple / dict arguments included (up to ``NEST_MAX``
  deep): :func:`tensors`, :func:`leaves`, and :func:`rebuilt`, which swaps tensors for their clones (how the
  candidate is kept from the real inputs: ``shadowd.hook.site``);
* what an output is checked against without reading a value: the call's key (:func:`out_key`: the first
  tensor argument's trailing shape and dtype) and the baseline's output meta per key (:func:`out_meta`), against
  which :func:`meta_error` names a candidate output's wrong ``type``, ``dtype`` or ``shape``; and
  :func:`expect_tensor`, the check that the baseline's result is one tensor (what a site compares).

Attribute reads only: nothing here synchronises the GPU, so the CUDA path (``shadowd.hook.cuda_call``) uses it
on the serving thread and under graph capture.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["NEST_MAX", "OUT_KEYS_MAX", "expect_tensor", "first_tensor", "key_of", "leaves", "meta_error", "out_key",
           "out_meta", "rebuilt", "tensors"]

#: how deep the hook looks into list / tuple / dict arguments for tensors (to protect them from the candidate)
NEST_MAX = 4
#: output keys (:func:`out_key`) a site remembers the baseline's output for (on mode's unchecked calls)
OUT_KEYS_MAX = 64


def leaves(x: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """The tensors in an argument: itself, or inside (nested) lists, tuples and dicts."""
    if isinstance(x, torch.Tensor):
        yield x
    elif depth < NEST_MAX and isinstance(x, (list, tuple)):
        for v in x:
            yield from leaves(v, depth + 1)
    elif depth < NEST_MAX and isinstance(x, dict):
        for v in x.values():
            yield from leaves(v, depth + 1)


def rebuilt(x: Any, copies: dict[int, torch.Tensor], depth: int = 0) -> Any:
    """``x`` with every tensor that has a copy in ``copies`` (by id) replaced by it; containers holding none are
    returned as they are (the same object)."""
    if isinstance(x, torch.Tensor):
        return copies.get(id(x), x)
    if depth >= NEST_MAX or not isinstance(x, (list, tuple, dict)):
        return x
    if isinstance(x, dict):
        vals = {k: rebuilt(v, copies, depth + 1) for k, v in x.items()}
        return x if all(vals[k] is v for k, v in x.items()) else vals
    items = [rebuilt(v, copies, depth + 1) for v in x]
    if all(a is b for a, b in zip(items, x, strict=True)):
        return x
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # a namedtuple
        return type(x)(*items)
    return tuple(items) if isinstance(x, tuple) else items


def tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """Every tensor among a call's arguments, those inside list / tuple / dict arguments included (:func:`leaves`),
    positional ones first."""
    out: list[torch.Tensor] = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):  # (the common case without a generator: this runs on every call)
            out.append(a)
        elif isinstance(a, (list, tuple, dict)):
            out.extend(leaves(a))
    return out


def first_tensor(args: tuple[Any, ...]) -> torch.Tensor | None:
    """The first positional tensor argument (what :func:`out_key` and output metas are taken from), or None."""
    return next((a for a in args if isinstance(a, torch.Tensor)), None)


def out_key(args: tuple[Any, ...]) -> Any:
    """What the expected output's dtype, device and trailing shape are keyed by: the first tensor argument's
    trailing shape and dtype (SGLang's verify: q's heads and width)."""
    return key_of(first_tensor(args))


def key_of(t0: torch.Tensor | None) -> Any:
    """:func:`out_key` of a call whose first tensor argument is ``t0`` (already found)."""
    return None if t0 is None else (t0.shape[1:], t0.dtype)


def out_meta(out: torch.Tensor, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """What an output must look like for the same key (:func:`out_key`): dtype, device, rank, trailing shape and
    whether its rows follow the first tensor argument's."""
    return _meta_of(out, first_tensor(args))


def _meta_of(out: torch.Tensor, t0: torch.Tensor | None) -> tuple[Any, ...]:
    n = out.dim()
    follows = t0 is not None and n > 0 and t0.dim() > 0 and out.shape[0] == t0.shape[0]
    return out.dtype, out.device, n, out.shape[1:], follows


def meta_error(out: Any, t0: torch.Tensor | None, want: tuple[Any, ...] | None) -> str | None:
    """What is wrong with a candidate output ``out`` that shows without reading a value: no tensor (``type``), or
    unlike the baseline's output for the same key (``want``, :func:`out_meta`; None: not known): ``dtype`` or
    ``shape`` (device, rank, trailing shape, rows). ``t0``: the call's first tensor argument. Attribute reads only:
    it cannot synchronise, and cannot raise on a tensor."""
    if not isinstance(out, torch.Tensor):
        return "type"
    if want is None:
        return None
    got = _meta_of(out, t0)
    if got != want:
        return "dtype" if got[0] != want[0] else "shape"
    return None


def expect_tensor(out_b: Any) -> None:
    """Raise TypeError unless the baseline's result is one tensor: a site compares one output (the hook's fault
    handler then disables the candidate, names what the baseline returned, and still returns it)."""
    if not isinstance(out_b, torch.Tensor):
        raise TypeError(f"the baseline returned a {type(out_b).__name__}: a ShadowSite compares one output tensor")
