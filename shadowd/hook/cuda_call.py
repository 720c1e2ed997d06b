"""One shadowed call on CUDA tensors: no host synchronisation, no per-call allocation in the statistics, and
capturable in a CUDA graph (then no Python runs on replay). The state it uses is ``shadowd.hook.device``'s.

Per call, on the current stream::

    control kernel   reads the mode / sampling / spot-check / disabled / fallback state
                     (the host's control word: an argument eagerly, its device mirror under a
                     graph, plus device words) and the candidate's error word when the site has
                     one (on mode: a raised word makes this call a checked one that the baseline
                     serves), advances the device step and call counters, decides do_stats and
                     use_cand for this call, stamps t0 (globaltimer)
    baseline(...)
    stamp kernel     t1
    candidate(...)   on protected inputs (clones of small tensors)
    stamp kernel     t2 (eager calls; under a graph the stats kernel reads t2 at its start)
    stats kernel     fused statistics over the real rows only (count read from device memory;
                     nothing when do_stats is 0): every program folds its partials into the
                     site's accumulator row with atomics, and the program drawing the last
                     ticket writes the ring slot in pinned host memory (record + metadata, and
                     the candidate's own error word when the site has one: ``candidate_flag``),
                     runs the on-mode hard check (sticky device fallback flag), publishes the
                     slot's sequence number last behind a system-scope release, and resets
                     the accumulator for the next call
    select kernel    (on mode only) the call's output: candidate, or baseline when use_cand is
                     0 or the fallback flag is set (so a failing spot check returns the baseline);
                     a served candidate output with a NaN / Inf in a real row makes the layer's
                     next call a spot check (sstate[15], read by the next control kernel)

Eagerly, Python decides (``host_decides``): an unsampled validate call runs the baseline alone and
an unchecked on-mode call the candidate alone (and, once per step, an asynchronous copy of the candidate's error
word into pinned host memory, which the unchecked calls read first: a raised word falls back before the next
spot check; with it comes the candidate's non-finite output word when it has one, and a raised one makes every
call of the next step a checked one). Under capture the kernels decide on every replay,
so sampling, spot checks, the kill switch and the fallback all work without Python. A graph cannot
skip a node, so a captured on-mode call runs the baseline too — unless the call site has a
``baseline_gate`` (the SGLang verify site does): then a gate kernel hands the baseline zero work sizes
(``gated_copy``) on replays that are neither spot checks nor fallbacks, and the graph runs at the
candidate's speed; spot-check replays run both and are checked before the select kernel chooses.
Without a gate both run on every replay, so every on-mode call is checked (hard limits,
candidate-only non-finite) before its output is chosen. A record is published on spot-check steps
and for every hard failure. Likewise, in validate mode, a call site with a ``candidate_gate`` (the SGLang
verify site) hands the candidate zero work sizes on replays that do not compare it: unsampled calls, the
kill switch, a disabled candidate — so sampling 1 in N under a graph saves the candidate's time on the
other N − 1 replays, as it does eagerly. In on mode a site with both gates has its candidate's work sizes
gated in the baseline gate's launch (``merged_gate_launches``: no node more): the candidate works on replays
that serve or check it, and does nothing once the kill switch, a fall-back or the promotion gate's hold has
the baseline serve.
:meth:`DeviceState.poll` (called by the streamer's thread) drains the ring into samples.

Eager calls only (a replay runs no Python): oracle sampling — 1 in ``oracle_every`` sampled validate calls
run the site's oracle, then candidate vs oracle and baseline vs oracle go through the statistics kernel as
records of their own (``REC_ORACLE_*``, published before their call's record, which says they precede it),
merged by :meth:`DeviceState.poll` into the call's sample (``oracle_cand_err`` / ``oracle_base_err``: max
|side − oracle|, NaN where either holds a non-finite value); and repro bundles, taken by
``shadowd.hook.capture`` (a failing call at once, a numeric breach on the next sampled call of that site and
layer). Limits of the CUDA path today: a fractional ``SHADOWD_SAMPLE`` becomes 1-in-round(1/f) steps; timing
comes from ``globaltimer`` stamps (graph-safe) rather than CUDA events; in eager on mode a fall-back found by
a spot check takes effect on device for that call at once and for later calls when the streamer's thread next
drains the ring.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any

import torch
import triton

from shadowd.hook.arguments import expect_tensor, first_tensor, key_of, meta_error
from shadowd.hook.device import DeviceState, Slot
from shadowd.hook.diffstats import empty_stats
from shadowd.hook.launch import (
    REC_MAIN,
    REC_MAIN_ORACLE,
    REC_ORACLE_BASE,
    REC_ORACLE_CAND,
    launch_stats,
    merged_gate_launches,
)
from shadowd.hook.triton_control import control_kernel, select_kernel, stamp_kernel

if TYPE_CHECKING:
    from shadowd.hook.site import Bucket, ShadowSite

__all__ = ["device_call"]

log = logging.getLogger("shadowd.hook")
BLOCK = 1024  # elements per program of the select kernel


class _Progress:
    """Where a call is, for :func:`device_call`'s handler: inside the baseline (its exception is the caller's), and
    the baseline's ungated result once it has one."""

    __slots__ = ("in_baseline", "out_b")

    def __init__(self) -> None:
        self.in_baseline = False
        self.out_b: Any = None


def _baseline(site: ShadowSite, args: tuple[Any, ...], kwargs: dict[str, Any], p: _Progress,
              ungated: bool = True) -> Any:
    p.in_baseline = True
    out = site.baseline(*args, **kwargs)
    p.in_baseline = False
    if ungated:
        p.out_b = out
    return out


def device_call(site: ShadowSite, args: tuple[Any, ...], kwargs: dict[str, Any], layer: int, b: Bucket,
                advance: bool) -> Any:
    """One shadowed call on CUDA tensors (eager or under CUDA-graph capture).

    What the hook's own code raises here — the device state, a launch of its kernels, a site's gate — never
    reaches the caller: the candidate is disabled for the process (with the reason, and one sample whose error
    is ``hook:<exception type>``, so the collector sees it and no verdict passes over it), and the baseline's
    result is returned (a run of its own when the baseline had not run, or ran gated). What the baseline raises
    is the caller's, as without the hook. ``advance``: this call starts a new verify step
    (:meth:`ShadowSite.advances_step`, asked once by the caller)."""
    p = _Progress()
    try:
        return _call(site, args, kwargs, layer, b, p, advance)
    except Exception as e:
        if p.in_baseline:
            raise
        site.rt.disable(f"hook error: {type(e).__name__}: {e}")  # (first: the baseline run below may raise too)
        out = p.out_b if p.out_b is not None else _baseline(site, args, kwargs, p)
        return site._hook_fault(e, layer, b, "on" if site.rt.mode_code == 2 else "validate", out)


def _flag_tensor(site: ShadowSite, device: torch.device) -> torch.Tensor | None:
    """The site's ``candidate_flag`` on ``device`` when it is one (an int32 tensor there), else None (warned)."""
    if site.candidate_flag is None:
        return None
    flag, err = site._isolated("candidate_flag", site.candidate_flag, device)
    if flag is None or err is not None:
        return None
    if not isinstance(flag, torch.Tensor) or flag.dtype != torch.int32 or flag.device != device or flag.numel() < 1:
        log.warning("shadowd[%s]: candidate_flag(%s) is not an int32 tensor on that device; not read", site.name,
                    device)
        return None
    return flag


def _flag_seen(site: ShadowSite) -> int:
    """Eager on mode: the candidate's error word as the last :func:`_watch_flag` copy found it (a pinned host word,
    read without a synchronisation: the copy lands when the stream reaches it; 0 until then, or without a word)."""
    w = site.flag_watch
    return int(w[2][0]) if w is not None else 0  # (a numpy read: indexing the tensor would cost a tensor op)


def _nonfinite_seen(site: ShadowSite) -> bool:
    """Eager on mode: the candidate's non-finite output word (the second element of its ``candidate_flag``) as the
    last :func:`_watch_flag` copy found it; a raised word is cleared here, on the device and in the copy (rare: a
    fill launch on the stream, before the candidate's next launch)."""
    w = site.flag_watch
    if w is None or w[2].shape[0] < 2 or not w[2][1]:
        return False
    w[0][1:2].zero_()
    w[2][1] = 0
    return True


def _watch_flag(site: ShadowSite) -> None:
    """Eager on mode, once per step after an unchecked candidate call: an asynchronous copy of the candidate's error
    word into its pinned host copy, so a word raised between spot checks is seen by the calls that follow (once the
    stream has run the copy) rather than by the next spot check, up to ``spot_every`` steps later."""
    w = site.flag_watch
    if w is not None:
        w[1].copy_(w[0], non_blocking=True)


def _oracle_records(site: ShadowSite, args: tuple[Any, ...], kwargs: dict[str, Any], out_c: torch.Tensor,
                    out_b: torch.Tensor, slot: Slot, ds: DeviceState, b: Bucket) -> bool:
    """Eager validate, 1 in ``oracle_every`` sampled calls: the site's oracle over protected copies of the inputs
    (``ShadowSite.run_oracle``), then candidate vs oracle and baseline vs oracle through the statistics kernel into
    the ring (fp32, no host synchronisation). True when both records were launched (the call's own record then
    says so)."""
    ref = site.run_oracle(args, kwargs)
    if ref is None:
        return False
    if not isinstance(ref, torch.Tensor) or ref.shape != out_b.shape or ref.device != out_b.device:
        raise TypeError(f"oracle output: expected a tensor of shape {tuple(out_b.shape)} on {out_b.device}")
    ref32 = ref.float()
    cfg = site.rt.config
    for kind, side in ((REC_ORACLE_CAND, out_c), (REC_ORACLE_BASE, out_b)):
        launch_stats(side.float(), ref32, slot.acc, ds.ring, ds.ring_seq, slot.sstate, ds.dstate,
                     valid_rows=b.valid_rows, hard_scaled=cfg.hard_scaled_max_abs, hard_rel_l2=cfg.hard_rel_l2,
                     site_id=slot.site_id, kind=kind)
    return True


def _capture_after_fallback(site: ShadowSite, ds: DeviceState, key: int, args: tuple[Any, ...],
                            kwargs: dict[str, Any], layer: int, b: Bucket, p: _Progress) -> Any:
    """On mode after a fall-back, at a call site that the failure armed (eager): the failing call's inputs were
    gone when the ring showed its failure, so the candidate runs once more beside the baseline, on protected
    inputs, only to be snapshotted for a bundle; the baseline's result is returned. (A *disabled* candidate —
    repeated errors, a modified input — never runs again.)"""
    out_b = _baseline(site, args, kwargs, p)
    cargs, ckwargs, watched, out_b = site._protect(args, kwargs, out_b)
    out_c, err = site._isolated("candidate", site.candidate, *cargs, **ckwargs)
    err = site._candidate_error(err, out_c, out_b, watched)
    site._isolated("bundle", ds.captures.snapshot, site, key, layer, b, "on", args, kwargs, out_b,
                   out_c if err is None else None, err)
    return out_b


def _call(site: ShadowSite, args: tuple[Any, ...], kwargs: dict[str, Any], layer: int, b: Bucket,
          p: _Progress, advance: bool) -> Any:
    rt = site.rt
    if rt.disabled:  # nothing of the hook runs (nor is its device state made: a fault there disabled it)
        return _baseline(site, args, kwargs, p)
    capturing = torch.cuda.is_current_stream_capturing()
    if capturing and not rt.has_device:
        # its counters and scratch would be allocated from the graph's pool and zeroed on every replay
        raise RuntimeError("the hook's device state cannot be created during graph capture: make one eager "
                           "call first (SGLang's graph runner does, in its warm-up)")
    ds: DeviceState = rt.device()
    if not site.flag_resolved and not capturing:  # looked up once, outside capture (the first call is eager)
        site.flag_resolved = True
        site.flag_tensor = _flag_tensor(site, ds.device)
        if site.flag_tensor is not None:  # (views and buffers made once here, not per call)
            words = site.flag_tensor.reshape(-1)[:2]  # the error word, and the non-finite word when there is one
            host = torch.zeros(words.shape[0], dtype=torch.int32).pin_memory()
            site.flag_watch = (words, host, host.numpy())
    if capturing and (id(site), layer) not in ds.slots:
        # the layer's decision words and accumulator now come from the graph's private pool: zero-filled again at
        # the start of every replay, and freed with the graph (SGLang's warm-up calls every layer eagerly first)
        log.warning("shadowd[%s]: layer %d is first called under graph capture; its device state comes from the "
                    "graph's memory pool (make one eager call of every layer before capturing)", site.name, layer)
    slot = ds.slot(site, layer)  # made by the first eager call, whatever that call then does (an unchecked one too)
    # a graph is built for the mode the promotion gate lets it reach (on, while the gate holds it at validate: the
    # control kernel reads the effective mode on every replay); an eager call acts in the effective mode
    code = rt.capture_code if capturing else rt.mode_code
    blocked = rt.disabled or rt.fallback
    if blocked:
        if rt.fallback and not rt.disabled and not capturing and rt.config.bundle_dir is not None:
            key = slot.site_id
            if ds.captures.wants(key):
                return _capture_after_fallback(site, ds, key, args, kwargs, layer, b, p)
        return _baseline(site, args, kwargs, p)
    host_decides, do_stats, use_cand = 1, 1, 0
    if not capturing:
        # (counted here; graph replays are counted by the control kernel)
        if code == 2 and rt.on_mode_covered(b.batch_size, b.draft_tokens, b.prefix_len):
            # (an output key not seen on a compared call yet — the first call — is checked)
            t0 = first_tensor(args)
            want = site.out_metas.get(key_of(t0))
            if want is not None and not rt.spot_checked(rt.step) and site.check_step != rt.step:
                word = _flag_seen(site)
                if word:  # raised by an earlier unchecked call: no candidate from here on
                    rt.fall_back(f"the candidate's error flag: {site.flag_text(word)}")
                    site.flag_error(word)
                    return _baseline(site, args, kwargs, p)
                if _nonfinite_seen(site):  # an unchecked call wrote a NaN / Inf: the next step is checked whole
                    site.check_step = rt.step + 1
                out, err = site._isolated("candidate", site.candidate, *args, **kwargs)
                if err is None:  # no tensor, or unlike the baseline's output (no values read: no synchronisation)
                    err = meta_error(out, t0, want)
                if err is None:
                    if layer == site.first_layer:
                        _watch_flag(site)
                    return out
                rt.fall_back(f"candidate {err}")
                return _baseline(site, args, kwargs, p)
            use_cand = 1
        elif not rt.sampled(rt.step):
            return _baseline(site, args, kwargs, p)
    else:
        host_decides = 0
    if ds.control_dirty:  # a change made while this thread was capturing (or a failed push)
        ds.push_control()
    slot.heads = max(1, b.heads)
    # on mode captured with a baseline gate: the baseline works only on spot-check / fallback replays
    gated = capturing and code == 2 and site.baseline_gate is not None
    meta = b.meta
    cfg = rt.config
    flag = site.flag_tensor
    control_kernel[(1,)](ds.dctrl, ds.word, ds.dstate, slot.sstate, meta if meta is not None else slot.sstate,
                         flag if flag is not None else ds.dstate, ds.cov, int(advance),
                         min(cfg.max_draft_tokens, 2**62), min(cfg.max_prefix_len, 2**62), host_decides, do_stats,
                         use_cand, rt.step, b.batch_size, b.draft_tokens, b.prefix_len,
                         HAS_META=meta is not None, HAS_FLAG=flag is not None, USE_TIMER=ds.use_timer,
                         GATED=int(gated), PDL=ds.pdl,
                         **ds.pdl_opts)
    gate_args = None  # the candidate's arguments with its work sizes gated (a site's candidate gate, under a graph)
    if gated:
        assert site.baseline_gate is not None
        with contextlib.ExitStack() as held:
            # the candidate is gated too (zero work on replays that neither serve nor check it: the kill switch, a
            # fall-back, the promotion gate's hold), in the baseline gate's launch: no graph node more
            with merged_gate_launches():
                if site.candidate_gate is not None:
                    gate_args = site.candidate_gate(slot.sstate, args, kwargs)
                held.enter_context(site.baseline_gate(slot.sstate, args, kwargs))
            out_b = _baseline(site, args, kwargs, p, ungated=False)
    else:
        out_b = _baseline(site, args, kwargs, p)
    expect_tensor(out_b)
    stamp_kernel[(1,)](slot.sstate, 7, USE_TIMER=ds.use_timer, PDL=ds.pdl, **ds.pdl_opts)
    if capturing and code == 1 and site.candidate_gate is not None:  # zero work on replays that do not use it
        gate_args = site.candidate_gate(slot.sstate, args, kwargs)
    if gate_args is not None:
        gargs, gkwargs = gate_args
        # the gate's outputs are already private copies: they are not cloned a second time
        fresh = {id(x) for x in (*gargs, *gkwargs.values())} - {id(x) for x in (*args, *kwargs.values())}
        cargs, ckwargs, watched, protected = site._protect(gargs, gkwargs, None if gated else out_b, fresh,
                                                           batch=True)
    else:
        cargs, ckwargs, watched, protected = site._protect(args, kwargs, None if gated else out_b, batch=capturing)
    if not gated:  # (a gated baseline's output is not what a replay returns, the select kernel's is)
        out_b = p.out_b = protected
    if not capturing:
        site.learn_output(out_b, args)
    out_c, err = site._isolated("candidate", site.candidate, *cargs, **ckwargs)
    # under a graph the statistics kernel reads the candidate's end at its start (one node fewer); eagerly a
    # stamp kernel follows the candidate at once, as the statistics kernel's start could wait for the host
    # (an oracle run, a first call's compile) after the candidate has finished
    if not capturing:
        stamp_kernel[(1,)](slot.sstate, 8, USE_TIMER=ds.use_timer, PDL=ds.pdl, **ds.pdl_opts)
    err = site._candidate_error(err, out_c, out_b, watched)
    if err is not None:
        site.consecutive_errors += 1
        if site.consecutive_errors >= cfg.disable_after or capturing:
            rt.disable(f"candidate {err}" + (" during graph capture" if capturing else ""))
        if gated:
            # this call's control kernel decides on replay before the failure, from the word as it was: it may
            # gate the baseline above to nothing, so the layer's output is a baseline run of its own, ungated
            out_b = _baseline(site, args, kwargs, p)
        sample = site._sample(layer, b, empty_stats(out_b.numel()), error=err,
                              mode="on" if code == 2 else "validate", cand_us=None, base_us=None)
        site._isolated("sink", rt.emit, sample)
        if cfg.bundle_dir is not None and not capturing:  # the failing call's inputs are still here
            site._isolated("bundle", ds.captures.snapshot, site, slot.site_id, layer, b, sample["mode"], args, kwargs,
                           out_b, out_c, err)
        if code == 2 and not capturing:
            rt.fall_back(f"spot check: {err}")
        return out_b
    kind = REC_MAIN
    if not capturing and code == 1 and site.oracle_due():
        done, _err = site._isolated("oracle", _oracle_records, site, args, kwargs, out_c, out_b, slot, ds, b)
        kind = REC_MAIN_ORACLE if done else REC_MAIN
    launch_stats(out_c, out_b, slot.acc, ds.ring, ds.ring_seq, slot.sstate, ds.dstate, valid_rows=b.valid_rows,
                 hard_scaled=cfg.hard_scaled_max_abs, hard_rel_l2=cfg.hard_rel_l2, site_id=slot.site_id, kind=kind,
                 stamp=capturing and ds.use_timer, cand_flag=site.flag_tensor)
    if cfg.bundle_dir is not None and not capturing and ds.captures.wants(slot.site_id):
        site._isolated("bundle", ds.captures.snapshot, site, slot.site_id, layer, b,
                       "on" if code == 2 else "validate", args, kwargs, out_b, out_c, None)
    if code != 2:
        return out_b
    out = torch.empty_like(out_b)
    n = out.numel()
    valid = b.valid_rows  # the real rows (a graph batch's padded rows hold whatever: not checked for NaN / Inf)
    row = n // out.shape[0] if out.dim() and out.shape[0] else 1
    limit = min(n, valid * row) if isinstance(valid, int) else n
    has_valid = isinstance(valid, torch.Tensor)
    select_kernel[(triton.cdiv(n, BLOCK),)](out, out_c.contiguous(), out_b.contiguous(), n, slot.sstate, ds.dstate,
                                          valid if has_valid else slot.sstate, row, limit, HAS_VALID=has_valid,
                                          BLOCK=BLOCK, PDL=ds.pdl, **ds.pdl_opts)
    return out
