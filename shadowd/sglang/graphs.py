"""CUDA graphs: is the shadow path safe to capture into SGLang's decode graph here? (startup check)

Target verify is captured into the decode CUDA graph; on replay no Python runs. The hook's CUDA
path (``shadowd.hook.cuda_call``) is built for that: device-side decisions and counters, pinned-host
ring, no host synchronisation, so sampling, spot checks, the kill switch and the fallback all act
on replay. What cannot be made safe, and is refused at startup (the server does not start, with a
message naming the flag that turns decode graphs off):

* the device path cannot be imported (no Triton, or a hook without it): the captured graph would
  contain a Python-level decision frozen at capture time;
* a candidate override (``SHADOWD_CANDIDATE``) that is not the project's capturable kernel (e.g.
  the oracle, which reads indices on the host);
* the oracle or repro bundles requested (``SHADOWD_ORACLE`` > 0, ``SHADOWD_BUNDLE_DIR``): the oracle
  runs on eager calls only (it reads the index pointers on the host) and bundles need the inputs on the
  host; neither can happen on a replay, so under graphs they would silently (almost) never happen.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from shadowd.hook.config import HookConfig

__all__ = ["DISABLE_FLAG", "LEGACY_FLAG", "GraphUnsafe", "check_graph_safety", "decode_graphs_enabled",
           "graph_refusal"]

log = logging.getLogger("shadowd.sglang")

DISABLE_FLAG = "--cuda-graph-backend-decode=disabled"
LEGACY_FLAG = "--disable-cuda-graph"
_CAPTURABLE_CANDIDATES = ("", "mla_tree_verify:tree_verify", "mla_tree_verify")


class GraphUnsafe(RuntimeError):
    """Shadowing cannot be captured safely in this configuration."""


def decode_graphs_enabled(model_runner: Any = None) -> bool:
    """Whether SGLang captures decode (and so target-verify) CUDA graphs in this process."""
    try:
        from sglang.srt.model_executor.cuda_graph_config import Backend, Phase
        from sglang.srt.runtime_context import get_exec

        cfg = get_exec().graph.cuda_graph_config
        if cfg is not None:
            return bool(getattr(cfg, Phase.DECODE).backend != Backend.DISABLED)
    except Exception:  # not published yet (early startup, tests) or another layout
        pass
    args = getattr(model_runner, "server_args", None)
    if args is not None and hasattr(args, "disable_cuda_graph"):
        return not bool(args.disable_cuda_graph)
    return False


def graph_refusal(config: HookConfig, env: Mapping[str, str] | None = None, *,
                  device_path_ok: bool | None = None) -> str | None:
    """Why the configured mode cannot run under captured decode graphs (None: it can)."""
    if config.mode == "off":
        return None
    e = os.environ if env is None else env
    if device_path_ok is None:
        try:
            import shadowd.hook.device  # noqa: F401

            device_path_ok = True
        except Exception as exc:
            log.warning("shadowd: the hook's CUDA path does not import: %r", exc)
            device_path_ok = False
    if not device_path_ok:
        return "the hook's graph-capturable CUDA path (shadowd.hook.device, needs Triton) is unavailable"
    cand = (e.get("SHADOWD_CANDIDATE") or "").strip()
    if cand not in _CAPTURABLE_CANDIDATES:
        return f"SHADOWD_CANDIDATE={cand} is not known to be CUDA-graph capturable"
    if config.oracle_every > 0:
        return "SHADOWD_ORACLE > 0: the oracle runs on eager calls only, never on a graph replay"
    if config.bundle_dir is not None:
        return "SHADOWD_BUNDLE_DIR (repro bundles) needs host reads that a graph replay never runs"
    return None


def check_graph_safety(config: HookConfig, graphs: bool, env: Mapping[str, str] | None = None, *,
                       device_path_ok: bool | None = None) -> None:
    """Raise :class:`GraphUnsafe` (naming the flag) when decode graphs are on and shadowing is unsafe."""
    if not graphs:
        return
    why = graph_refusal(config, env, device_path_ok=device_path_ok)
    if why is not None:
        raise GraphUnsafe(
            f"shadowd: refusing SHADOWD_MODE={config.mode} under CUDA graphs: {why}. Either fix that, or "
            f"start SGLang with {DISABLE_FLAG} (older releases: {LEGACY_FLAG}), or set SHADOWD_MODE=off.")
