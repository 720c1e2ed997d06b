"""Test-only stand-in for ``torchvision`` (declared: it cannot load beside a CPU torch —
"operator torchvision::nms does not exist"). sglang imports it at module level in multimodal
helpers the verify path never calls; every ``torchvision.*`` name resolves to an inert placeholder.
Nothing of sglang itself is stubbed.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

__all__ = ["install"]


class _Meta(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return name  # enum-like members (InterpolationMode.NEAREST_EXACT, ...)


class _Placeholder(metaclass=_Meta):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("torchvision stand-in: not available in the CPU tests")

    def __getattr__(self, name: str) -> Any:
        return _Placeholder()


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (_Placeholder,), {})


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        mod = _StubModule(spec.name)
        mod.__path__ = []  # type: ignore[attr-defined]
        mod.__version__ = "0.0.0+shadowd-test-stub"  # type: ignore[attr-defined]
        return mod

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def install() -> None:
    """Put the stand-in in front of the import system (no-op if a real torchvision imports)."""
    if any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    try:
        import torchvision  # noqa: F401

        return
    except Exception:
        sys.modules.pop("torchvision", None)
    sys.meta_path.insert(0, _Finder())
