"""Records every Triton kernel launch made under ``TRITON_INTERPRET=1``, for compiling the same launches for GPUs.

Imported by a subprocess before the code under test runs (``tests/hook/conftest.py``'s ``interp_run``): it wraps
the interpreter's launch so that each launch's kernel (module and name), argument types in Triton's signature
notation, constexpr values and launch options are kept, and writes the distinct ones as JSON to the file named by
``SHADOWD_RECORD_LAUNCHES`` when the process exits. ``test_kernels_build.py`` then compiles exactly these launches
for sm_90 and sm_120 without a GPU: the interpreter accepts code that Triton's compiler refuses (a plain module
global read in a kernel, session 32), so a kernel that only ever ran interpreted on the CPU could still fail on
its first GPU launch.
"""

from __future__ import annotations

import atexit
import inspect
import json
import os
from typing import Any

import torch
import triton.runtime.interpreter as interpreter

__all__ = ["describe_launch"]

_DTYPES = {torch.float64: "fp64", torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
           torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
           torch.bool: "u1"}


def _specialize(name: str, value: Any, specialize: bool) -> tuple[str, bool]:
    # (Triton's type for a runtime argument, whether the JIT marks it divisible by 16), as its launch specializes
    # it: 16-byte aligned pointers and integers that are multiples of 16 get the hint unless the kernel lists them
    # in ``do_not_specialize``; integers are i32 when they fit; bools u1
    if isinstance(value, torch.Tensor):
        if value.dtype not in _DTYPES:
            raise TypeError(f"{name}: no Triton pointer type recorded for {value.dtype}")
        return "*" + _DTYPES[value.dtype], specialize and value.data_ptr() % 16 == 0
    if isinstance(value, bool):
        return "u1", False
    if isinstance(value, int):
        kind = "i32" if -(2**31) <= value < 2**31 else ("i64" if value < 2**63 else "u64")
        return kind, specialize and value % 16 == 0
    if isinstance(value, float):
        return "fp32", False
    raise TypeError(f"{name}: no Triton signature type recorded for {type(value).__name__}")


def describe_launch(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """One launch of the interpreted kernel ``fn`` as ``{"module", "name", "signature", "constexprs", "aligned",
    "options"}``: Triton's signature notation per parameter ("constexpr" for constexpr parameters, ``None`` and —
    unless the kernel does not specialize them — integers equal to 1, as the JIT makes them), their values, the
    parameters the JIT would mark divisible by 16, and the launch options (``num_warps`` …)."""
    params = list(inspect.signature(fn.fn).parameters.values())
    names = [p.name for p in params]
    keep = set(fn.kwargs.get("do_not_specialize") or ())
    bound = dict(zip(names, args, strict=False))
    bound.update({k: v for k, v in kwargs.items() if k in names})
    signature: dict[str, str] = {}
    constexprs: dict[str, Any] = {}
    aligned: list[str] = []
    for p in params:
        value = bound.get(p.name, p.default)
        if value is inspect.Parameter.empty:
            raise TypeError(f"{fn.fn.__name__}: no value for {p.name}")
        specialize = p.name not in keep
        if "constexpr" in str(p.annotation) or value is None or (specialize and type(value) is int and value == 1):
            if not isinstance(value, (bool, int, float, str, type(None))):
                raise TypeError(f"{fn.fn.__name__}: constexpr {p.name} is a {type(value).__name__}")
            signature[p.name] = "constexpr"
            constexprs[p.name] = value
            continue
        signature[p.name], hint = _specialize(p.name, value, specialize)
        if hint:
            aligned.append(p.name)
    options = {k: v for k, v in kwargs.items() if k not in names}
    return {"module": fn.fn.__module__, "name": fn.fn.__name__, "signature": signature, "constexprs": constexprs,
            "aligned": aligned, "options": options}


_seen: dict[str, dict[str, Any]] = {}
_run = interpreter.InterpretedFunction.run


def _recording_run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
    launch = describe_launch(self, args, kwargs)
    _seen.setdefault(json.dumps(launch, sort_keys=True), launch)
    return _run(self, *args, grid=grid, warmup=warmup, **kwargs)


def _write() -> None:
    with open(os.environ["SHADOWD_RECORD_LAUNCHES"], "w") as f:
        json.dump(list(_seen.values()), f)


interpreter.InterpretedFunction.run = _recording_run  # type: ignore[method-assign]
atexit.register(_write)
