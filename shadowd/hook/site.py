"""One shadowed call site: a baseline and a candidate over the same inputs (the experiment pattern).

``ShadowSite(name, baseline, candidate)(*args, layer=..., bucket=Bucket(...), **kwargs)``:

* **off** — ``baseline(*args, **kwargs)``; one attribute check of overhead.
* **validate** — the baseline runs and *its* result is returned, bit for bit. On sampled steps
  the candidate runs on the same inputs; diff statistics go to the sink. Candidate exceptions,
  NaN/Inf, wrong shape or dtype, modified inputs, an error word raised by its kernels
  (``candidate_flag``) become samples (``error``), never errors in serving; ``disable_after``
  consecutive candidate errors disable it for the process (a modified input or a raised error word: at once).
* **on** — the candidate's result is returned; every ``spot_every``-th step both run and are
  compared; a hard failure (candidate-only non-finite, max-abs or rel-L2 beyond the hard
  limits, an exception, a wrong shape/dtype) returns the baseline's result for that call and
  makes the process fall back to the baseline for good (reported as ``fallback``). Shapes
  outside the covered buckets (those the promotion gate's verdict covered, ``shadowd.hook.coverage``, and the
  static ``max_draft_tokens`` / ``max_prefix_len``) are served by the baseline (and shadowed as in validate, to
  gather coverage).

How the candidate is kept from modifying inputs: tensor arguments up to ``clone_max_bytes``
(q, indices, masks; inside list / tuple / dict arguments too) are passed to the candidate as clones (under
graph capture all in one graph node: ``shadowd.hook.copies``), so it never sees the real tensors;
larger ones, and those the site names ``shared`` (the KV cache), are shared. The autograd version counters
of both are compared before and after the candidate: a torch in-place write (into a clone as well) is
recorded as ``error=input_modified`` and the candidate disabled at once. Raw-pointer writes from a custom
kernel are out of reach in-process; they are excluded before deployment by the kernel's
sanitizer runs. The baseline always runs first, on the untouched inputs, and its result is copied when it
shares memory with a shared input (``ShadowSite._protect``). The oracle gets its inputs the same way
(``ShadowSite.run_oracle``): one that writes into an ``out`` argument never changes the result returned.

Every callback the site does not own — candidate, oracle, sink, bundle writer — runs inside
:meth:`ShadowSite._isolated`, the one place that handles what they raise. On CUDA tensors the
call goes through ``shadowd.hook.cuda_call`` (graph-capturable, no host synchronisation).
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Collection
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from shadowd.hook.arguments import (
    OUT_KEYS_MAX,
    expect_tensor,
    first_tensor,
    key_of,
    leaves,
    meta_error,
    out_key,
    out_meta,
    rebuilt,
    tensors,
)
from shadowd.hook.copies import clone_many
from shadowd.hook.diffstats import empty_stats, hard_failure, max_abs_chunked, stats_torch
from shadowd.hook.runtime import HookRuntime, get_runtime

__all__ = ["Bucket", "BundleArgs", "CandidateFlag", "CandidateGate", "ShadowSite"]

log = logging.getLogger("shadowd.hook")

#: ``candidate_gate(sstate, args, kwargs) -> (args, kwargs)``, see :class:`ShadowSite`
CandidateGate = Callable[[torch.Tensor, tuple[Any, ...], dict[str, Any]], tuple[tuple[Any, ...], dict[str, Any]]]
#: ``candidate_flag(device) -> int32 tensor | None``: the candidate's own error word, see :class:`ShadowSite`
CandidateFlag = Callable[[torch.device], "torch.Tensor | None"]
#: ``bundle_args(args, kwargs, max_bytes) -> (args, kwargs, refs) | None``, see :class:`ShadowSite`
BundleArgs = Callable[[tuple[Any, ...], dict[str, Any], int],
                      "tuple[tuple[Any, ...], dict[str, Any], dict[str, str]] | None"]


@dataclass
class Bucket:
    """The shape of one verify call (what the statistics are bucketed by).

    ``valid_rows``: real (non-padded) output rows, an int or — under CUDA graphs — a device
    tensor holding it; ``meta``: optional device int64 tensor ``[batch_size, draft_tokens,
    prefix_len]`` read by the kernels on replay (graph batches change without Python running).
    """

    batch_size: int = 1
    draft_tokens: int = 1
    prefix_len: int = 0
    heads: int = 1
    new_requests: int | None = None
    valid_rows: int | torch.Tensor | None = None
    meta: torch.Tensor | None = None


class ShadowSite:
    """A shadowed call site (see the module docstring).

    ``oracle``: optional fp32 reference over the same inputs (eager only, 1 in ``oracle_every``
    sampled validate calls); ``refs``: optional ``"module:function"`` names of baseline,
    candidate and oracle, written into repro bundles so ``shadowd replay`` can find them.
    """

    def __init__(self, name: str, baseline: Callable[..., Any], candidate: Callable[..., Any], *,
                 oracle: Callable[..., Any] | None = None, runtime: HookRuntime | None = None,
                 first_layer: int = 0, clone_max_bytes: int = 64 * 2**20,
                 refs: dict[str, str] | None = None,
                 baseline_gate: Callable[..., AbstractContextManager[Any]] | None = None,
                 candidate_gate: CandidateGate | None = None, bundle_args: BundleArgs | None = None,
                 shared: Collection[int | str] = (), candidate_flag: CandidateFlag | None = None,
                 describe_flag: Callable[[int], str] | None = None) -> None:
        self.name = name
        self.baseline = baseline
        #: on mode under a CUDA graph: ``baseline_gate(sstate, args, kwargs)`` is a context manager in
        #: which the baseline reads its work size through device memory that the call's decision words
        #: ``sstate`` (device int64, set by the control kernel per replay) zero on replays that are not
        #: spot checks (``shadowd.hook.device.gated_copy``), so a captured graph's baseline does almost
        #: nothing there (see shadowd.hook.cuda_call)
        self.baseline_gate = baseline_gate
        #: under a CUDA graph (validate; on mode beside a ``baseline_gate``, both made in one launch):
        #: ``candidate_gate(sstate, args, kwargs) -> (args, kwargs)`` returns the call's arguments with the
        #: candidate's work sizes replaced by new tensors from ``gated_copy(..., RUN_CAND)``, zero on replays that
        #: neither compare nor serve the candidate (unsampled calls, kill switch, disabled or fallen-back
        #: candidate, the promotion gate's hold); those copies are the candidate's own, the other arguments are
        #: protected as usual
        self.candidate_gate = candidate_gate
        #: repro bundles on the CUDA path (``shadowd.hook.capture``): ``bundle_args(args, kwargs, max_bytes)``
        #: returns the call's inputs in a self-contained, compact form — private device copies — with the
        #: ``refs`` that replay them, or None when they would exceed ``max_bytes``; default: every tensor copied
        self.bundle_args = bundle_args
        #: ``candidate_flag(device)``: the int32 error word the candidate's kernels raise bits in when they clamp
        #: bad input (``mla_tree_verify``'s ``error_flag``: sticky, never cleared by them), the same tensor the
        #: candidate is given; a non-zero word is a candidate error (``candidate_flag:0x..``: the candidate is
        #: disabled, in on mode the call falls back). On CUDA the statistics kernel reads it into the call's
        #: record (no host synchronisation; under a graph on every replay that computes statistics), so bits
        #: raised on an unsampled call are reported by the next sampled one. In on mode a word raised between spot
        #: checks falls back before the next one: under a graph the control kernel reads it on every replay (the
        #: next replay serves the baseline), eagerly a pinned copy made once per step does (``flag_watch``), and on
        #: the CPU path the call itself does. ``describe_flag`` names the bits. The tensor may hold a second
        #: element, the candidate's *non-finite output* word (``mla_tree_verify``'s ``nonfinite_flag``: set when it
        #: writes a NaN or an Inf): eagerly in on mode, where unchecked calls run no hook kernel, the per-step copy
        #: brings it along and a raised word makes every call of the next step a checked one (the origin layer's
        #: inputs are clean again there, the later layers' were not), then the hook clears it; under a graph the
        #: select kernel sees a served NaN / Inf itself, per layer.
        self.candidate_flag = candidate_flag
        self.describe_flag = describe_flag or (lambda v: f"0x{v:x}")
        #: the CUDA path's ``candidate_flag(device)``, looked up on the site's first call outside graph capture
        self.flag_tensor: torch.Tensor | None = None
        self.flag_resolved = False
        #: eager on mode on CUDA: (the words' device view — the error word, and the non-finite word when there is
        #: one —, a pinned host copy, that copy's numpy view), the copy refreshed once per step by an asynchronous
        #: copy after the candidate and read (no synchronisation, no tensor op) before each unchecked call
        #: (``cuda_call``)
        self.flag_watch: tuple[torch.Tensor, torch.Tensor, Any] | None = None
        #: eager on mode: the step whose every call is checked (the candidate's non-finite word was seen)
        self.check_step = -1
        self.candidate = candidate
        self.oracle = oracle
        self.rt = runtime or get_runtime()
        self.rt.join_site(name)
        self.first_layer = first_layer
        self.clone_max_bytes = clone_max_bytes
        #: argument positions / keyword names never cloned for the candidate, whatever their size (watched
        #: instead): a cache shared by design, which a clone per call would copy through memory and L2
        self.shared = frozenset(shared)
        self.refs = refs or {}
        #: on mode: what the baseline's output looked like per :func:`out_key` (dtype, device, trailing shape),
        #: learnt on compared calls; an unchecked call's output must match it, and a key not seen yet is checked
        self.out_metas: dict[Any, tuple[Any, ...]] = {}
        self._step_mark = -1  # the runtime's step at this site's previous first-layer call (advances_step)
        self.consecutive_errors = 0
        self.oracle_calls = 0
        #: why oracle sampling stopped for this process (an oracle that wrote into a shared input), else None
        self.oracle_off: str | None = None
        self.errors: dict[str, int] = {}
        self._bundles: Any = None

    # ---- the one place that handles what foreign code raises ----------------------------------------
    def _isolated(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, str | None]:
        try:
            return fn(*args, **kwargs), None
        except (KeyboardInterrupt, SystemExit):  # Ctrl-C, and sys.exit in a signal handler (SIGTERM): the process's
            raise
        except BaseException as e:  # GeneratorExit and other BaseExceptions raised by foreign code: samples
            err = f"exception:{type(e).__name__}"
            self.errors[what] = self.errors.get(what, 0) + 1
            if self.errors[what] <= 3:
                log.warning("shadowd[%s]: %s raised %r", self.name, what, e)
            return None, err

    # ---- the call ---------------------------------------------------------------------------------
    def __call__(self, *args: Any, layer: int = 0, bucket: Bucket | None = None, **kwargs: Any) -> Any:
        rt = self.rt
        code = rt.mode_code
        if code == 0:
            return self.baseline(*args, **kwargs)
        rt.calls += 1
        advance = self.advances_step(layer)  # (once per call: it updates the site's mark)
        if advance:
            rt.step += 1
        b = bucket or Bucket()
        if any(t.is_cuda for t in tensors(args, kwargs)[:1]):
            from shadowd.hook.cuda_call import device_call

            return device_call(self, args, kwargs, layer, b, advance)
        step = rt.step
        blocked = rt.disabled or rt.fallback
        if code == 2 and not blocked and rt.on_mode_covered(b.batch_size, b.draft_tokens, b.prefix_len):
            t0 = first_tensor(args)
            want = self.out_metas.get(key_of(t0))
            if want is not None and not rt.spot_checked(step):
                versions = [(t, t._version) for t in tensors(args, kwargs)]
                out, err = self._isolated("candidate", self.candidate, *args, **kwargs)
                if err is None:
                    # between spot checks the baseline is not run, but much of what is wrong with an output is
                    # recognisable on its own: never serve it (CPU path, no device sync)
                    found, ierr = self._isolated("candidate output", self.unchecked_error, out, t0, want, b,
                                                 versions)
                    err = ierr or found
                if err is None:
                    return out
                if err == "input_modified":  # (the baseline below then reads what the candidate wrote)
                    rt.disable("candidate modified its inputs")
                rt.fall_back(f"candidate {err}")
                return self.baseline(*args, **kwargs)
            return self._shadow(args, kwargs, layer, b, "on")
        if blocked or not rt.sampled(step):
            return self.baseline(*args, **kwargs)
        return self._shadow(args, kwargs, layer, b, "validate")

    def advances_step(self, layer: int) -> bool:
        """Whether this call starts a new verify step: the first layer's call of the runtime's *first* site (a
        second site sharing the runtime — another op of the same layers — must not advance it again, or sampling
        and spot checks would skip whole site / layer pairs). Ask once per call: the answer updates the site's
        mark of the step it last saw."""
        if layer != self.first_layer:
            return False
        rt = self.rt
        ref = rt.step_site
        owner = ref() if ref is not None else None
        mark, self._step_mark = self._step_mark, rt.step
        # this one takes over: the first such call; the owner is gone (a site replaced); or the owner advanced
        # nothing since this site's previous first-layer call (it is no longer called)
        if owner is None or (owner is not self and mark == rt.step):
            rt.step_site = weakref.ref(self)
            owner = self
        return owner is self

    def unchecked_error(self, out: Any, t0: torch.Tensor | None, want: tuple[Any, ...] | None, b: Bucket,
                        versions: list[tuple[torch.Tensor, int]]) -> str | None:
        """On mode on the CPU path, a call served without the baseline: what is wrong with the candidate's run that
        shows without one — an input it wrote in place, an output that is no tensor or unlike the baseline's for the
        same key (``want``, from :attr:`out_metas`; ``t0``: the first tensor argument: :func:`meta_error`), a NaN /
        Inf in a real row, a raised error word. (The CUDA path reads no values: it checks :func:`meta_error` alone
        and has its own words.)"""
        if any(t._version != v for t, v in versions):
            return "input_modified"
        wrong = meta_error(out, t0, want)
        if wrong is not None:
            return wrong
        valid = b.valid_rows if isinstance(b.valid_rows, int) and out.dim() else None
        if not bool(torch.isfinite(out if valid is None else out[:valid]).all()):  # (padded rows: not served)
            return "nonfinite"
        word = self._flag_word(out.device)  # reading the word costs nothing here
        return self.flag_error(word) if word else None

    def learn_output(self, out_b: Any, args: tuple[Any, ...]) -> None:
        """On mode: remember what the baseline's output looks like for this call's key (the ``OUT_KEYS_MAX`` latest
        keys); nothing in the other modes (the kill switch only lowers the mode: nothing reads it there)."""
        if self.rt.mode_code == 2 and isinstance(out_b, torch.Tensor):
            key = out_key(args)
            if key not in self.out_metas and len(self.out_metas) >= OUT_KEYS_MAX:  # the oldest key goes
                self.out_metas.pop(next(iter(self.out_metas)))
            self.out_metas[key] = out_meta(out_b, args)

    def _protect(self, args: tuple[Any, ...], kwargs: dict[str, Any], out_b: Any = None,
                 private: set[int] | None = None, batch: bool = False
                 ) -> tuple[tuple[Any, ...], dict[str, Any], list[tuple[torch.Tensor, int]], Any]:
        """The candidate's arguments, the (tensor, version) pairs to compare after it, and the baseline's result
        ``out_b``, copied when it shares memory with an input the candidate is handed itself (a shared or large
        one: a baseline that wrote into a buffer it was given), so that what the candidate writes there never
        becomes the result returned."""
        # ``private``: ids of tensors that are already the candidate's own copies (a candidate gate's);
        # ``batch``: copy them with clone_many — under graph capture, where launches cost replay time; eagerly the
        # host's time is what a call waits for, and a clone each costs it less than clone_many's views
        # Tensors inside list / tuple / dict arguments are protected like top-level ones (``shared`` names the
        # top-level argument holding them); a tensor passed twice gets one copy. The copies are watched as well:
        # a candidate that writes into an input it was given (even a copy) is one that, served in on mode, would
        # corrupt the caller's real inputs.
        watched: list[tuple[torch.Tensor, int]] = []
        cloned: dict[int, torch.Tensor] = {}
        seen: set[int] = set()
        for key, arg in [*enumerate(args), *kwargs.items()]:
            for x in leaves(arg):
                if id(x) in seen or (private and id(x) in private):
                    continue
                seen.add(id(x))
                if key not in self.shared and x.numel() * x.element_size() <= self.clone_max_bytes:
                    cloned[id(x)] = x
                else:
                    watched.append((x, x._version))
        if isinstance(out_b, torch.Tensor) and watched:  # (the copies below are new memory: never the result's)
            ptr = out_b.untyped_storage().data_ptr()
            if any(t.untyped_storage().data_ptr() == ptr for t, _ in watched):
                out_b = out_b.clone()
        xs = list(cloned.values())
        made = clone_many(xs) if batch else [x.detach().clone() for x in xs]
        watched += [(c, c._version) for c in made]
        copies = dict(zip(cloned, made, strict=True))
        return (tuple(rebuilt(a, copies) for a in args), {k: rebuilt(v, copies) for k, v in kwargs.items()},
                watched, out_b)

    def _candidate_error(self, err: str | None, out_c: Any, out_b: Any,
                         watched: list[tuple[torch.Tensor, int]]) -> str | None:
        """What is wrong with a candidate run that returned ``out_c`` (``err``: what it raised): the exception,
        a modified input (the candidate is disabled at once), or a wrong type, shape or dtype."""
        if err is None and any(t._version != v for t, v in watched):
            err = "input_modified"
            self.rt.disable("candidate modified its inputs")
        return err if err is not None else self._check(out_c, out_b)

    def _flag_word(self, device: Any) -> int:
        """The candidate's error word on the CPU path (0 without a ``candidate_flag``, or when it fails)."""
        if self.candidate_flag is None:
            return 0
        flag, ferr = self._isolated("candidate_flag", self.candidate_flag, device)
        return int(flag.reshape(-1)[0]) if ferr is None and isinstance(flag, torch.Tensor) and flag.numel() else 0

    def flag_text(self, value: int) -> str:
        """The bits of the candidate's error word in words (``describe_flag``, isolated: hex if it fails)."""
        text, err = self._isolated("describe_flag", self.describe_flag, value)
        return str(text) if err is None else f"0x{value:x}"

    def flag_error(self, value: int) -> str:
        """A non-zero error word of the candidate's (``candidate_flag``): counted in the producer's ``device_errors``
        (the collector's ``shadowd_producer_device_errors``), the candidate disabled for the process with the bits
        named; returns the sample's error, ``candidate_flag:0x<bits>``."""
        self.rt.device_errors += 1
        if not self.rt.disabled:
            self.rt.disable(f"the candidate's error flag: {self.flag_text(value)}")
        return f"candidate_flag:0x{value:x}"

    def _check(self, out_c: Any, out_b: Any) -> str | None:
        if not isinstance(out_c, torch.Tensor):
            return "type"
        if out_c.shape != out_b.shape:
            return "shape"
        if out_c.dtype != out_b.dtype:
            return "dtype"
        return None

    def _shadow(self, args: tuple[Any, ...], kwargs: dict[str, Any], layer: int, b: Bucket, mode: str) -> Any:
        t0 = time.perf_counter_ns()
        out_b = self.baseline(*args, **kwargs)  # what it raises is the caller's, as without the hook
        base_us = (time.perf_counter_ns() - t0) / 1e3
        try:
            return self._compare(args, kwargs, layer, b, mode, out_b, base_us)
        except Exception as e:
            return self._hook_fault(e, layer, b, mode, out_b)

    def _hook_fault(self, err: Exception, layer: int, b: Bucket, mode: str, out_b: Any) -> Any:
        """The one place for what the hook's own code raised during a call (not the candidate's, the oracle's or
        a sink's: :meth:`_isolated` has those): the candidate is disabled for the process with the reason, the
        traceback logged, one sample with error ``hook:<exception type>`` sent (the verdict counts it as a hard
        failure), and the baseline's result ``out_b`` returned."""
        rt = self.rt
        log.error("shadowd: the hook failed; serving the baseline", exc_info=err)
        rt.disable(f"hook error: {type(err).__name__}: {err}")
        numel = out_b.numel() if isinstance(out_b, torch.Tensor) else 0
        sample = self._sample(layer, b, empty_stats(numel), error=f"hook:{type(err).__name__}", mode=mode,
                              cand_us=None, base_us=None)
        self._isolated("sink", rt.emit, sample)
        return out_b

    def _compare(self, args: tuple[Any, ...], kwargs: dict[str, Any], layer: int, b: Bucket, mode: str, out_b: Any,
                 base_us: float) -> Any:
        # _shadow after the baseline: the candidate on protected inputs, the statistics, the sample, the result
        rt = self.rt
        expect_tensor(out_b)
        cargs, ckwargs, watched, out_b = self._protect(args, kwargs, out_b)
        self.learn_output(out_b, args)
        t2 = time.perf_counter_ns()
        out_c, err = self._isolated("candidate", self.candidate, *cargs, **ckwargs)
        t3 = time.perf_counter_ns()
        err = self._candidate_error(err, out_c, out_b, watched)
        if err is None:  # (CPU path: reading the word costs nothing here)
            value = self._flag_word(out_b.device)
            if value:
                err = self.flag_error(value)
        valid = b.valid_rows if isinstance(b.valid_rows, int) else None
        row = out_b[0].numel() if out_b.dim() and out_b.shape[0] else 1
        valid_numel = None if valid is None else valid * row
        if err is None:
            stats, serr = self._isolated("stats", stats_torch, out_c, out_b, valid_numel)
            if serr is not None:
                stats, err = None, "stats_failed"
        else:
            stats = None
        if stats is None:
            stats = empty_stats(out_b.numel() if valid_numel is None else valid_numel)
        hard = err or hard_failure(stats, rt.config.hard_scaled_max_abs, rt.config.hard_rel_l2)
        if err is not None or stats["cand_nonfinite"] > 0:
            rt.candidate_failures += 1
            self.consecutive_errors += 1
            if self.consecutive_errors >= rt.config.disable_after:
                rt.disable(f"{self.consecutive_errors} consecutive candidate errors ({err or 'nonfinite'})")
        else:
            self.consecutive_errors = 0
        oracle_errs: tuple[float | None, float | None] = (None, None)
        if mode == "validate" and err is None and self.oracle_due():
            oracle_errs = self._oracle(args, kwargs, out_c, out_b)
        sample = self._sample(layer, b, stats, error=err, mode=mode, cand_us=(t3 - t2) / 1e3, base_us=base_us,
                              oracle=oracle_errs)
        self._isolated("sink", rt.emit, sample)
        tol = stats["rel_l2"] > rt.config.bundle_rel_l2
        if rt.config.bundle_dir is not None and (hard or tol):
            self._isolated("bundle", self._save_bundle, args, kwargs, out_b, out_c, sample, hard or "tolerance")
        if mode == "on":
            if hard:
                rt.fall_back(f"spot check: {hard}")
                return out_b
            return out_c
        return out_b

    def run_oracle(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The site's oracle (isolated) on protected inputs, as the candidate gets them: clones of the tensors up to
        ``clone_max_bytes`` (so an oracle that writes into an ``out`` argument the baseline returned cannot change
        the result the caller gets), the shared ones watched. An oracle that writes into a shared input is not
        called again in this process (logged). Returns its output, or None where it raised."""
        assert self.oracle is not None
        oargs, okwargs, watched, _ = self._protect(args, kwargs)
        # (what it writes into its own copies is harmless: an oracle is never served)
        own = {id(x) for arg in (*args, *kwargs.values()) for x in leaves(arg)}
        shared = [(t, v) for t, v in watched if id(t) in own]
        ref, err = self._isolated("oracle", self.oracle, *oargs, **okwargs)
        if any(t._version != v for t, v in shared):
            self.oracle_off = "the oracle modified its inputs"
            log.error("shadowd[%s]: the oracle wrote into a shared input; oracle sampling is off for this process",
                      self.name)
        return None if err is not None else ref

    def oracle_due(self) -> bool:
        """Whether this sampled validate call also runs the oracle (1 in ``oracle_every``; counts the call)."""
        if self.oracle is None or self.oracle_off is not None or self.rt.config.oracle_every <= 0:
            return False
        self.oracle_calls += 1
        return self.oracle_calls % self.rt.config.oracle_every == 0

    def _oracle(self, args: tuple[Any, ...], kwargs: dict[str, Any], out_c: Any, out_b: Any
                ) -> tuple[float | None, float | None]:
        ref = self.run_oracle(args, kwargs)
        if not isinstance(ref, torch.Tensor) or ref.shape != out_b.shape:
            return None, None
        rows = self.rt.config.oracle_chunk_rows
        return max_abs_chunked(out_c, ref, rows), max_abs_chunked(out_b, ref, rows)

    def _sample(self, layer: int, b: Bucket, stats: dict[str, Any], *, error: str | None, mode: str,
                cand_us: float | None, base_us: float | None,
                oracle: tuple[float | None, float | None] = (None, None)) -> dict[str, Any]:
        rt = self.rt
        s = {k: v for k, v in stats.items() if k != "max_pos"}
        s.update(layer=layer, rank=rt.config.rank, step=rt.step, call=rt.calls, ts=time.time(),
                 batch_size=max(1, b.batch_size), draft_tokens=max(1, b.draft_tokens), prefix_len=b.prefix_len,
                 heads=max(1, b.heads), error=error, mode=mode, oracle_cand_err=oracle[0],
                 oracle_base_err=oracle[1], cand_us=cand_us, base_us=base_us,
                 new_requests=b.new_requests if layer == self.first_layer else None)
        return s

    def _save_bundle(self, args: tuple[Any, ...], kwargs: dict[str, Any], out_b: Any, out_c: Any,
                     sample: dict[str, Any], reason: str, refs: dict[str, str] | None = None) -> Any:
        # ``refs`` given: the arguments are already in the site's bundle form (shadowd.hook.capture)
        cfg = self.rt.config
        if self._bundles is None:
            from shadowd.hook.bundle import BundleWriter

            assert cfg.bundle_dir is not None
            self._bundles = BundleWriter(cfg.bundle_dir, cfg.bundle_max, cfg.bundle_max_bytes)
        if refs is None and self.bundle_args is not None:
            packed = self.bundle_args(args, kwargs, cfg.bundle_max_bytes)
            if packed is None:
                self._bundles.skipped += 1
                return None
            args, kwargs, refs = packed
        return self._bundles.save(self.name, args, kwargs, out_b, out_c, sample, reason,
                                  self.refs if refs is None else refs)
