"""Repro bundles: the exact inputs and both outputs of a call that failed or exceeded tolerance.

A bundle is a directory ``<root>/<n:05d>-<site>-<reason>/`` with

* ``tensors.safetensors`` — every tensor argument (``arg.<i>`` / ``kwarg.<name>``, moved to the
  CPU, made contiguous) and the outputs ``out.baseline`` / ``out.candidate``;
* ``meta.json`` — site name, reason, the sample (statistics and shape bucket), the non-tensor
  arguments (JSON values, or their ``repr`` marked ``unserializable``) and the optional
  ``module:function`` references of baseline / candidate / oracle.

Bounded: at most ``max_count`` bundles and ``max_bytes`` in total per process (a bundle that
would cross the byte bound is not written). Saving runs on the calling thread, in the eager
path only (it copies tensors), and only for calls that already failed or exceeded tolerance.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

__all__ = ["BundleWriter", "json_safe"]


def json_safe(x: Any) -> Any:
    """A JSON value for ``x``: numbers (non-finite as strings), strings, lists, dicts, else a marker."""
    if x is None or isinstance(x, (bool, int, str)):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else repr(x)
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    if isinstance(x, dict):
        return {str(k): json_safe(v) for k, v in x.items()}
    return {"unserializable": repr(x)[:200]}


class BundleWriter:
    """Writes bundles under ``root`` within the count and byte bounds."""

    def __init__(self, root: Path, max_count: int, max_bytes: int) -> None:
        self.root = Path(root)
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.count = 0
        self.nbytes = 0
        self.skipped = 0

    def save(self, site: str, args: tuple[Any, ...], kwargs: dict[str, Any], out_b: Any, out_c: Any,
             sample: dict[str, Any], reason: str, refs: dict[str, str] | None = None) -> Path | None:
        """Write one bundle; None when a bound stops it."""
        tensors: dict[str, torch.Tensor] = {}
        plain_args: list[Any] = []
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                tensors[f"arg.{i}"] = a
                plain_args.append({"tensor": f"arg.{i}"})
            else:
                plain_args.append(json_safe(a))
        plain_kwargs: dict[str, Any] = {}
        for k, v in kwargs.items():
            if isinstance(v, torch.Tensor):
                tensors[f"kwarg.{k}"] = v
                plain_kwargs[k] = {"tensor": f"kwarg.{k}"}
            else:
                plain_kwargs[k] = json_safe(v)
        if isinstance(out_b, torch.Tensor):
            tensors["out.baseline"] = out_b
        if isinstance(out_c, torch.Tensor):
            tensors["out.candidate"] = out_c
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        if self.count >= self.max_count or self.nbytes + size > self.max_bytes:
            self.skipped += 1
            return None
        self.count += 1
        self.nbytes += size
        tag = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{site}-{reason}")[:80]
        path = self.root / f"{self.count:05d}-{tag}"
        path.mkdir(parents=True, exist_ok=True)
        save_file({k: t.detach().to("cpu").contiguous() for k, t in tensors.items()},
                  str(path / "tensors.safetensors"))
        meta = {"site": site, "reason": reason, "sample": json_safe(sample), "args": plain_args,
                "kwargs": plain_kwargs, "refs": refs or {}, "torch": torch.__version__}
        (path / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
        return path
