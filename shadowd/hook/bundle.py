"""Repro bundles: the exact inputs and both outputs of a call that failed or exceeded tolerance.

A bundle is a directory ``<root>/<n:05d>-<site>-<reason>/`` with

* ``tensors.safetensors`` — every tensor argument (``arg.<i>`` / ``kwarg.<name>``, moved to the
  CPU, made contiguous) and the outputs ``out.baseline`` / ``out.candidate``;
* ``meta.json`` — site name, reason, the sample (statistics and shape bucket), the non-tensor
  arguments (JSON values, or their ``repr`` marked ``unserializable``), the optional
  ``module:function`` references of baseline / candidate / oracle, and the bundle ``format``
  (:data:`BUNDLE_FORMAT`; ``shadowd replay`` refuses another).

Bounded: at most ``max_count`` bundles and ``max_bytes`` in total **in the directory**, whoever
wrote them (the sites of a process, the TP ranks sharing ``SHADOWD_BUNDLE_DIR``, a restarted
process): a bundle that would cross a bound is not written. Writers take turns on an exclusive
``flock`` of the directory: the count and bytes are read from the directory under it, a
bundle is written into ``.partial-…`` and renamed into place, so a reader never sees half a
bundle, no two writers share a directory, and what a writer that died mid-bundle left is removed
by the next one. Saving runs on the calling thread (the CPU path) or the streamer's
(``shadowd.hook.capture``), and only for calls that already failed or exceeded tolerance.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

__all__ = ["BUNDLE_FORMAT", "BundleWriter", "json_safe"]

#: the layout of ``meta.json`` and ``tensors.safetensors`` this version writes and reads (a bundle without the
#: field is of this format: written before it existed)
BUNDLE_FORMAT = 1
_PARTIAL = ".partial-"
_NUMBERED = re.compile(r"^(\d{5,})-")


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


@contextlib.contextmanager
def _locked(root: Path) -> Iterator[None]:
    """The directory's writer lock: ``flock`` on the directory itself (between processes, and between threads:
    one open of it each), so that the directory holds nothing but bundles."""
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # (releases the lock)


def _host_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors of their own: safetensors refuses tensors that share memory (an output that is one
    of the arguments, an ``out=`` buffer returned, a view of an input), so those are copied."""
    out: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for k, t in tensors.items():
        h = t.detach().to("cpu").contiguous()
        ptr = h.untyped_storage().data_ptr()
        if ptr in storages:
            h = h.clone()
        elif h.numel():
            storages.add(ptr)
        out[k] = h
    return out


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


class BundleWriter:
    """Writes bundles under ``root`` within the count and byte bounds of the directory (see the module docstring).

    ``count`` and ``nbytes``: what this writer wrote; ``skipped``: the bundles a bound stopped; ``full``: the
    directory held ``max_count`` bundles at the last attempt (no more will be written until some are removed).
    """

    def __init__(self, root: Path, max_count: int, max_bytes: int) -> None:
        self.root = Path(root)
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.count = 0
        self.nbytes = 0
        self.skipped = 0
        self.full = max_count <= 0

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
        meta = {"format": BUNDLE_FORMAT, "site": site, "reason": reason, "sample": json_safe(sample),
                "args": plain_args, "kwargs": plain_kwargs, "refs": refs or {}, "torch": torch.__version__}
        text = json.dumps(meta, indent=2, sort_keys=True)
        # (the tensors' bytes plus what safetensors and meta.json add: a few hundred bytes)
        size = sum(t.numel() * t.element_size() for t in tensors.values()) + len(text) + 1024
        tag = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{site}-{reason}")[:80]
        with _locked(self.root):
            numbers = [0]
            count = used = 0
            for entry in self.root.iterdir():
                if entry.name.startswith(_PARTIAL):  # a writer died mid-bundle (the lock is ours)
                    shutil.rmtree(entry, ignore_errors=True)
                    continue
                m = _NUMBERED.match(entry.name)
                if m is None or not entry.is_dir():
                    continue
                numbers.append(int(m.group(1)))
                count += 1
                used += _dir_bytes(entry)
            self.full = count >= self.max_count
            if self.full or used + size > self.max_bytes:
                self.skipped += 1
                return None
            name = f"{max(numbers) + 1:05d}-{tag}"
            partial = self.root / f"{_PARTIAL}{name}-{os.getpid()}"
            partial.mkdir()
            try:
                save_file(_host_tensors(tensors), str(partial / "tensors.safetensors"))
                (partial / "meta.json").write_text(text)
                path = self.root / name
                partial.rename(path)
            except BaseException:
                shutil.rmtree(partial, ignore_errors=True)
                raise
            self.count += 1
            self.nbytes += _dir_bytes(path)
            self.full = count + 1 >= self.max_count
        return path
