"""Rerun a repro bundle (``shadowd.hook.bundle``): baseline, candidate and oracle on the saved inputs.

``replay_bundle(path)`` resolves the callables from the bundle's ``refs`` (``module:function``)
unless given, reruns each on the exact saved inputs, and returns a dict with

* ``saved``: the statistics of the saved candidate output against the saved baseline output;
* ``rerun``: the statistics of the rerun candidate against the rerun baseline;
* ``reproducible``: max |rerun - saved| per side over finite positions (0 when the kernels are
  deterministic; NaN when the non-finite positions differ);
* ``oracle``: max |candidate - oracle| and max |baseline - oracle| when an oracle is available;
* ``errors``: what raised while rerunning, or could not be imported;
* ``missing``: the callables neither the bundle's ``refs`` nor the caller named (nothing to rerun).

:func:`format_report` renders it for a terminal (what ``shadowd replay BUNDLE`` prints).
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from shadowd.hook.diffstats import max_abs_chunked, stats_torch

__all__ = ["format_report", "load_bundle", "replay_bundle", "resolve"]


def resolve(ref: str | None) -> Callable[..., Any] | None:
    """``"package.module:function"`` → the function (None for None)."""
    if not ref:
        return None
    mod, _, attr = ref.partition(":")
    obj: Any = importlib.import_module(mod)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def load_bundle(path: str | Path, device: str | None = None
                ) -> tuple[tuple[Any, ...], dict[str, Any], dict[str, torch.Tensor], dict[str, Any]]:
    """(args, kwargs, outputs, meta) of a bundle; tensors on ``device`` (default: where they can run).

    Raises ValueError, naming the bundle and what is wrong, for anything that is not a bundle as
    :class:`shadowd.hook.bundle.BundleWriter` writes it (a missing, truncated or unreadable file, a ``meta.json``
    of another shape or ``format``, an argument naming a tensor the file does not hold)."""
    p = Path(path)
    if not (p / "meta.json").is_file() or not (p / "tensors.safetensors").is_file():
        raise ValueError(f"{p}: not a repro bundle (it needs meta.json and tensors.safetensors)")
    try:
        meta = json.loads((p / "meta.json").read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{p}: meta.json cannot be read: {e}") from None
    _check_meta(p, meta)
    try:
        loaded = load_file(str(p / "tensors.safetensors"))
    except Exception as e:  # safetensors' own error for a truncated / foreign file, or OSError
        raise ValueError(f"{p}: tensors.safetensors cannot be read: {type(e).__name__}: {e}") from None
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    tensors = {k: v.to(dev) for k, v in loaded.items()}

    def value(x: Any, where: str) -> Any:
        if isinstance(x, dict) and set(x) == {"tensor"}:
            if x["tensor"] not in tensors:
                raise ValueError(f"{p}: meta.json's {where} names tensor {x['tensor']!r}, which "
                                 "tensors.safetensors does not hold")
            return tensors[x["tensor"]]
        return x

    args = tuple(value(a, f"args[{i}]") for i, a in enumerate(meta["args"]))
    kwargs = {k: value(v, f"kwargs[{k!r}]") for k, v in meta["kwargs"].items()}
    outs = {k.split(".", 1)[1]: v for k, v in tensors.items() if k.startswith("out.")}
    return args, kwargs, outs, meta


def _check_meta(p: Path, meta: Any) -> None:
    from shadowd.hook.bundle import BUNDLE_FORMAT

    def bad(what: str) -> ValueError:
        return ValueError(f"{p}: not a repro bundle this shadowd can read: meta.json {what}")

    if not isinstance(meta, dict):
        raise bad(f"holds a {type(meta).__name__}, not an object")
    fmt = meta.get("format", BUNDLE_FORMAT)
    if fmt != BUNDLE_FORMAT or isinstance(fmt, bool):
        raise bad(f"is of format {fmt!r}; this shadowd reads format {BUNDLE_FORMAT}")
    if not isinstance(meta.get("args"), list):
        raise bad("has no 'args' list")
    if not isinstance(meta.get("kwargs", {}), dict):
        raise bad("has a 'kwargs' that is not an object")
    meta.setdefault("kwargs", {})
    refs = meta.get("refs") or {}
    if not isinstance(refs, dict) or not all(isinstance(v, str) for v in refs.values()):
        raise bad("has 'refs' that are not an object of 'module:function' strings")


def _stats(c: torch.Tensor | None, b: torch.Tensor | None) -> dict[str, Any] | None:
    if c is None or b is None or c.shape != b.shape:
        return None
    s = stats_torch(c.cpu(), b.cpu())
    return {k: s[k] for k in ("max_abs", "max_pos", "mean_abs", "rel_l2", "cos_diff", "out_scale",
                              "cand_nonfinite", "base_nonfinite", "nan_cand", "nan_base")}


def replay_bundle(path: str | Path, baseline: Callable[..., Any] | None = None,
                  candidate: Callable[..., Any] | None = None, oracle: Callable[..., Any] | None = None,
                  device: str | None = None) -> dict[str, Any]:
    """Rerun the bundle at ``path``; see the module docstring for the result."""
    args, kwargs, outs, meta = load_bundle(path, device)
    refs = meta.get("refs") or {}
    given = {"baseline": baseline, "candidate": candidate, "oracle": oracle}
    fns: dict[str, Callable[..., Any] | None] = {}
    errors: dict[str, str] = {}
    for name, fn in given.items():
        try:
            fns[name] = fn or resolve(refs.get(name))
        except Exception as e:  # a ref this environment cannot import (or whose module raises on import)
            fns[name] = None
            errors[name] = f"cannot import {refs.get(name)!r}: {type(e).__name__}: {e}"
    missing = [name for name in ("baseline", "candidate") if fns[name] is None and name not in errors]
    rerun: dict[str, torch.Tensor | None] = {}
    for name, fn in fns.items():
        rerun[name] = None
        if fn is None:
            continue
        try:
            out = fn(*args, **kwargs)
            rerun[name] = out if isinstance(out, torch.Tensor) else None
        except Exception as e:
            errors[name] = f"{type(e).__name__}: {e}"
    result: dict[str, Any] = {
        "bundle": str(path), "site": meta.get("site"), "reason": meta.get("reason"),
        "sample": meta.get("sample"), "errors": errors, "missing": missing,
        "saved": _stats(outs.get("candidate"), outs.get("baseline")),
        "rerun": _stats(rerun["candidate"], rerun["baseline"]),
        "reproducible": {}, "oracle": {},
    }
    for side in ("baseline", "candidate"):
        new, old = rerun[side], outs.get(side)
        if new is not None and old is not None and new.shape == old.shape:
            same = stats_torch(new.cpu(), old.cpu())  # non-finite at the same positions counts as equal
            mismatch = same["cand_nonfinite"] + same["base_nonfinite"]
            result["reproducible"][side] = same["max_abs"] if mismatch == 0 else float("nan")
    ref = rerun["oracle"]
    if ref is not None:
        for side in ("candidate", "baseline"):
            out = rerun[side] if rerun[side] is not None else outs.get(side)
            if out is not None and out.shape == ref.shape:
                result["oracle"][f"{side}_err"] = max_abs_chunked(out, ref, 1024)
    return result


def format_report(result: dict[str, Any]) -> str:
    """A terminal rendering of :func:`replay_bundle`'s result."""
    lines = [f"bundle {result['bundle']}: site {result['site']}, saved because {result['reason']}"]
    for key in ("saved", "rerun"):
        s = result.get(key)
        if s:
            lines.append(f"  {key:6s} candidate vs baseline: max_abs {s['max_abs']:.3e} at {s['max_pos']}, "
                         f"rel_l2 {s['rel_l2']:.3e}, cos_diff {s['cos_diff']:.3e}, "
                         f"candidate-only non-finite {s['cand_nonfinite']}, "
                         f"baseline-only non-finite {s['base_nonfinite']}")
        elif key == "rerun" and result.get("missing"):
            lines.append(f"  rerun  candidate vs baseline: not run: no {' and no '.join(result['missing'])} to call "
                         "(the bundle's meta.json names none: save bundles from a ShadowSite(refs={'baseline': "
                         "'module:function', ...}), or pass --baseline / --candidate module:function)")
        else:
            lines.append(f"  {key:6s} candidate vs baseline: not comparable (an output is missing or the shapes "
                         "differ)")
    for side, v in result.get("reproducible", {}).items():
        lines.append(f"  rerun {side} vs saved: max_abs {v:.3e}")
    for k, v in result.get("oracle", {}).items():
        lines.append(f"  oracle {k}: {v:.3e}")
    for k, v in result.get("errors", {}).items():
        lines.append(f"  {k} raised: {v}")
    return "\n".join(lines)
