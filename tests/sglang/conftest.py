"""Fixtures for the SGLang plugin tests: the REAL sglang package (scripts/install-sglang-cpu.sh).

Without sglang the tests skip with the reason, except in CI (``CI=true``), where they fail.
Declared test-only stand-in: ``torchvision`` (tests/sglang/torchvision_stub.py) — it cannot load
beside a CPU torch; nothing of sglang is stubbed. Triton runs in its interpreter (fp32).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")  # before sglang/triton define their kernels

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
ENTRY = "shadowd.sglang_plugin:register"
ENTRIES = (ENTRY, "shadowd.sglang.plugin:register")


def _need_sglang() -> None:
    try:
        import sglang  # noqa: F401
        import triton  # noqa: F401
    except ImportError as e:
        why = f"sglang is not installed ({e}); run scripts/install-sglang-cpu.sh"
        if IN_CI:
            pytest.fail(f"CI must run the SGLang plugin tests: {why}")
        pytest.skip(why)
    from tests.sglang import torchvision_stub

    torchvision_stub.install()


@pytest.fixture(scope="session")
def sgl() -> Any:
    """The real ``sglang.srt.layers.attention.triton_backend`` module."""
    _need_sglang()
    import sglang.srt.layers.attention.triton_backend as tb

    return tb


@pytest.fixture(scope="session")
def entry_point(tmp_path_factory: pytest.TempPathFactory, sgl: Any) -> str:
    """Make the plugin's entry point visible to ``importlib.metadata`` (a test dist-info, if the
    installed shadowd does not declare it yet); returns the entry point's name."""
    from importlib.metadata import entry_points

    for ep in entry_points(group="sglang.srt.plugins"):
        if ep.value in ENTRIES:
            return ep.name
    root = tmp_path_factory.mktemp("eps")
    dist = root / "shadowd_sglang_plugin_test-0.0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: shadowd-sglang-plugin-test\nVersion: 0.0.0\n")
    (dist / "entry_points.txt").write_text(f"[sglang.srt.plugins]\nshadowd = {ENTRY}\n")
    sys.path.append(str(root))
    return "shadowd"


@pytest.fixture
def fresh_plugins(sgl: Any, entry_point: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A clean plugin state: sglang's load guard and HookRegistry reset, patched targets restored."""
    import sglang.srt.plugins as plugins
    from sglang.srt.managers.scheduler_components.metrics_reporter import SchedulerMetricsReporter
    from sglang.srt.plugins.hook_registry import HookRegistry

    import shadowd.sglang.plugin as plugin
    from shadowd.hook.runtime import set_runtime

    cls = sgl.TritonAttnBackend
    saved = [(cls, n, cls.__dict__[n]) for n in ("forward_extend", "__init__")]
    saved.append((SchedulerMetricsReporter, "update_spec_metrics",
                  SchedulerMetricsReporter.__dict__["update_spec_metrics"]))
    monkeypatch.setenv("SGLANG_PLUGINS", entry_point)
    for var in ("SHADOWD_MODE", "KDTREE_VERIFY", "SHADOWD_URL", "SHADOWD_CANDIDATE", "SHADOWD_ORACLE",
                "SHADOWD_BUNDLE_DIR"):
        monkeypatch.delenv(var, raising=False)
    HookRegistry.reset()
    plugins._plugins_loaded = False
    plugin._STATE = plugin.State()
    set_runtime(None)
    yield plugins
    for owner, name, fn in saved:
        setattr(owner, name, fn)
    HookRegistry.reset()
    plugins._plugins_loaded = False
    plugin._STATE = plugin.State()
    set_runtime(None)


@pytest.fixture
def tmp_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path
