"""The in-process hook: runs inside the inference server (torch; never FastAPI/SQLAlchemy).

* :class:`ShadowSite` — one shadowed call site (off / validate / on), see ``shadowd.hook.site``;
* :class:`HookRuntime` / :func:`get_runtime` — per-process state (mode, kill switch, sink);
* :class:`HookConfig` — configuration from ``SHADOWD_*`` (and ``KDTREE_VERIFY``);
* :class:`Streamer` — the non-blocking background sender with its on-disk spool;
* :func:`stats_torch` — the diff statistics (CPU); the fused GPU pass lives in
  ``shadowd.hook.triton_stats`` (its histogram in ``triton_hist``, its accumulator row and last
  program's record in ``triton_record``), the graph path's control kernels in
  ``triton_control``, the statistics kernel's launch in ``shadowd.hook.launch``, the CUDA call path in
  ``shadowd.hook.cuda_call`` and its device state in ``shadowd.hook.device`` (imported only on CUDA), the
  candidate's input copies under capture in ``shadowd.hook.copies``, repro bundles of CUDA calls in
  ``shadowd.hook.capture``;
* :func:`replay_bundle` — rerun a repro bundle (``shadowd.hook.replay``).

Submodules are imported lazily so that ``import shadowd.hook`` stays cheap.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Bucket", "HookConfig", "HookRuntime", "ShadowSite", "Streamer", "get_runtime", "replay_bundle",
           "set_runtime", "stats_torch"]

_WHERE = {
    "Bucket": "site", "ShadowSite": "site", "HookConfig": "config", "HookRuntime": "runtime",
    "get_runtime": "runtime", "set_runtime": "runtime", "Streamer": "streamer", "stats_torch": "diffstats",
    "replay_bundle": "replay",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(f"shadowd.hook.{_WHERE[name]}"), name)
    raise AttributeError(name)
