"""Make the package importable as ``mla_tree_verify`` from a source checkout (before pip install)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_KERNEL_DIR = Path(__file__).resolve().parents[2] / "kernel"

if importlib.util.find_spec("mla_tree_verify") is None and (_KERNEL_DIR / "__init__.py").exists():
    spec = importlib.util.spec_from_file_location(
        "mla_tree_verify", _KERNEL_DIR / "__init__.py", submodule_search_locations=[str(_KERNEL_DIR)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["mla_tree_verify"] = module
    spec.loader.exec_module(module)
