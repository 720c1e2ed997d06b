"""SGLang's speculative accept length per effective mode, from the scheduler's own counters.

An AROUND hook on ``SchedulerMetricsReporter.update_spec_metrics(bs, num_correct_drafts,
num_accept_tokens, ...)`` — the call SGLang makes once per verify step — adds the step to the
counters of the mode in effect (off / validate / on, kill switch applied; ``on`` only while the candidate is
served: an on-mode step after a fallback, or with the candidate disabled, serves SGLang's kernel and counts as
``validate``, as while the promotion gate holds; a step on a shape bucket the gate's verdict did not cover is served
by SGLang's kernel too but counts as ``on``: under CUDA graphs the control kernel decides that per replay, unseen by
the host — the run's ``on_mode_shapes`` counts those calls). ``accept length`` =
accepted tokens / request-steps, the same figure SGLang logs as ``accept len``; tokens per step
(accepted tokens per verify pass of the batch) too. The counters ride in every wire batch's
``producer_stats`` under :data:`STAT_KEYS` as far as the collector's wire knows those keys, and are
logged every ``log_every`` steps.
"""

from __future__ import annotations

import logging
from typing import Any

from shadowd.hook.runtime import HookRuntime, get_runtime

__all__ = ["STAT_KEYS", "TARGET", "SpecCounters"]

log = logging.getLogger("shadowd.sglang")

TARGET = ("sglang.srt.managers.scheduler_components.metrics_reporter.SchedulerMetricsReporter."
          "update_spec_metrics")
_MODES = ("off", "validate", "on")
#: producer_stats keys: accepted tokens, request-steps and verify passes per mode.
STAT_KEYS = tuple(f"spec_{what}_{m}" for m in _MODES for what in ("accept_tokens", "req_steps", "passes"))


class SpecCounters:
    """Per-mode accepted tokens / request-steps / verify passes (the hook: an AROUND callable)."""

    def __init__(self, runtime: HookRuntime | None = None, log_every: int = 1000) -> None:
        self._runtime = runtime
        self.log_every = log_every
        self.counts = dict.fromkeys(STAT_KEYS, 0)

    def record(self, bs: int, num_accept_tokens: int) -> None:
        rt = self._runtime or get_runtime()
        m = rt.mode
        if m == "on" and (rt.fallback or rt.disabled):  # SGLang's kernel is served: no on-mode step
            m = "validate"
        self.counts[f"spec_accept_tokens_{m}"] += int(num_accept_tokens)
        self.counts[f"spec_req_steps_{m}"] += int(bs)
        self.counts[f"spec_passes_{m}"] += 1
        passes = self.counts[f"spec_passes_{m}"]
        if self.log_every and passes % self.log_every == 0:
            log.info("shadowd: mode %s: accept length %.3f, tokens per step %.2f over %d verify passes",
                     m, *self.summary(m), passes)

    def summary(self, mode: str) -> tuple[float, float]:
        """(accept length, accepted tokens per verify pass) of ``mode`` so far (0 when none)."""
        tok = self.counts[f"spec_accept_tokens_{mode}"]
        steps = self.counts[f"spec_req_steps_{mode}"]
        passes = self.counts[f"spec_passes_{mode}"]
        return (tok / steps if steps else 0.0, tok / passes if passes else 0.0)

    def producer_stats(self, known: tuple[str, ...] | None = None) -> dict[str, int]:
        """The counters the wire format knows (all of them when ``known`` is None)."""
        return {k: v for k, v in self.counts.items() if known is None or k in known}

    def __call__(self, original: Any, reporter: Any, bs: int, num_correct_drafts: int, num_accept_tokens: int,
                 *args: Any, **kwargs: Any) -> Any:
        out = original(reporter, bs, num_correct_drafts, num_accept_tokens, *args, **kwargs)
        try:
            self.record(bs, num_accept_tokens)
        except Exception as e:  # never break SGLang's metrics
            log.debug("shadowd: spec counters: %r", e)
        return out
