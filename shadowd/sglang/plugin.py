"""The SGLang plugin entry point (group ``sglang.srt.plugins``): ``shadowd.sglang.plugin:register``.

SGLang's ``load_plugins()`` runs :func:`register` in every process it starts (main, schedulers /
TP workers, detokenizer), then applies the hooks registered with its ``HookRegistry``.

* ``SHADOWD_MODE`` (or the seed's ``KDTREE_VERIFY``) unset or ``off``: nothing is registered, SGLang
  runs byte-identically.
* ``validate`` / ``on``: AROUND hooks on ``TritonAttnBackend.forward_extend`` (the MLA tree-verify
  shadow, :mod:`shadowd.sglang.verify`), ``TritonAttnBackend.__init__`` (per-process setup:
  runtime, rank, CUDA-graph safety, run registration, :mod:`shadowd.sglang.process`) and
  ``SchedulerMetricsReporter.update_spec_metrics`` (accept length per mode, :mod:`shadowd.sglang.spec`).
* an untested SGLang (:mod:`shadowd.sglang.compat`) or an invalid mode: only the ``__init__``
  hook is registered, and it raises the error when the model's attention backend is built, so the
  server does not start half-configured (``load_plugins`` itself only logs plugin exceptions).

This module imports sglang lazily: ``import shadowd`` works without it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from shadowd.hook.config import HookConfig, parse_mode

__all__ = ["BACKEND_INIT", "State", "register", "state"]

log = logging.getLogger("shadowd.sglang")

BACKEND_INIT = "sglang.srt.layers.attention.triton_backend.TritonAttnBackend.__init__"


class State:
    """What :func:`register` set up in this process (tests and diagnostics read it)."""

    def __init__(self) -> None:
        self.registered: list[str] = []
        self.mode: str | None = None
        self.verify: Any = None
        self.setup: Any = None
        self.spec: Any = None
        self.refusal: str | None = None


_STATE = State()


def state() -> State:
    return _STATE


def _refuse(message: str) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    log.error("%s", message)

    def refuse(original: Any, backend: Any, model_runner: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(model_runner, "is_draft_worker", False):
            return original(backend, model_runner, *args, **kwargs)
        raise RuntimeError(message)

    HookRegistry.register(BACKEND_INIT, refuse, HookType.AROUND)
    _STATE.registered.append(BACKEND_INIT)
    _STATE.refusal = message


def register(env: Mapping[str, str] | None = None) -> None:
    """Register the hooks for ``SHADOWD_MODE`` (idempotent within a process)."""
    e = os.environ if env is None else env
    if _STATE.registered:
        return
    raw = e.get("SHADOWD_MODE") or e.get("KDTREE_VERIFY")
    try:
        mode = parse_mode(raw)
    except ValueError as exc:
        _refuse(f"shadowd: invalid SHADOWD_MODE/KDTREE_VERIFY: {exc}")
        return
    if mode != "off":
        try:  # every other setting too, at start, named (not from the first worker's backend construction)
            HookConfig.from_env(e)
        except ValueError as exc:
            _refuse(f"shadowd: invalid configuration: {exc}")
            return
    _STATE.mode = mode
    if mode == "off":
        return
    from shadowd.sglang.compat import UntestedSGLang, check_version

    try:
        version = check_version(env=e)
    except UntestedSGLang as exc:
        _refuse(str(exc))
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from shadowd.sglang import spec, verify
    from shadowd.sglang.process import ProcessSetup

    _STATE.spec = spec.SpecCounters()
    _STATE.setup = ProcessSetup(version, _STATE.spec, e)
    _STATE.verify = verify.VerifyShadow()
    for target, hook in ((BACKEND_INIT, _STATE.setup.backend_init_hook), (verify.TARGET, _STATE.verify),
                         (spec.TARGET, _STATE.spec)):
        HookRegistry.register(target, hook, HookType.AROUND)
        _STATE.registered.append(target)
    log.info("shadowd: SGLang plugin registered (mode %s, sglang %s)", mode, version)
