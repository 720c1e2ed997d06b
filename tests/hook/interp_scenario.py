"""The device path's interpreted scenario: ``test_triton_interp.py``'s checks and the launches it makes.

Run as a script under ``TRITON_INTERPRET=1`` (the interpreter is chosen when kernels are defined) by
``tests/hook/conftest.py``'s ``interp_run``; it prints one ``RESULT`` line of JSON. CUDA-only calls are stood in
for (pinned memory -> plain tensors, one fake device); the system fence and timers are compiled out
(GPU/USE_TIMER), everything else is the kernels' own code.
"""
# ruff: noqa: E402, E702
import json
import math
from types import SimpleNamespace

import torch

torch.Tensor.pin_memory = lambda self: self
torch.cuda.current_device = lambda: 0
torch.cuda.get_device_properties = lambda d: SimpleNamespace(multi_processor_count=1)
CAPTURE = [False]
torch.cuda.is_current_stream_capturing = lambda: CAPTURE[0]
torch.cuda.Stream = lambda *a, **k: None  # the control word's stream: torch.cuda.stream(None) is a no-op
import shadowd.hook.device as dev

real_device = torch.device
dev.torch = SimpleNamespace(**{k: getattr(torch, k) for k in dir(torch) if not k.startswith("__")})
dev.torch.device = lambda *a: real_device("cpu")
dev.torch.cuda = torch.cuda
# CAPTURE stands for replays here (the kernels decide); the host's pushes of the control word come from
# outside any capture, as the streamer's thread makes them
dev.DeviceState._capturing = staticmethod(lambda: False)
from shadowd.hook import site as site_mod

site_mod.tensors = lambda a, k: [SimpleNamespace(is_cuda=True)]
from shadowd.hook.config import HookConfig, Sampling
from shadowd.hook.diffstats import finalize, stats_torch
from shadowd.hook.runtime import HookRuntime
from shadowd.hook.site import Bucket, ShadowSite

out = {}
g = torch.Generator().manual_seed(0)
b = torch.randn(37, 3, 32, generator=g)
c = b + 1e-3 * torch.randn(37, 3, 32, generator=g)
c[3, 1, 5] = float("nan"); b[7, 0, 1] = float("inf"); c[7, 0, 1] = float("inf"); b[9, 2, 9] = float("nan")
c[11, 0, 2] = b[11, 0, 2]
valid = torch.tensor([30], dtype=torch.int32)
got = finalize(dev.fused_raw_stats(c, b, valid).tolist())
ref = stats_torch(c, b, 30 * 96)
out["stats_equal"] = all((math.isnan(got[k]) and math.isnan(ref[k])) or got[k] == ref[k]
                         if isinstance(ref[k], float) else got[k] == ref[k] for k in ref if k != "max_pos")
out["stats_close"] = all(math.isclose(got[k], ref[k], rel_tol=1e-5) or (math.isnan(got[k]) and math.isnan(ref[k]))
                         for k in ref if isinstance(ref[k], float))
c2 = torch.where(torch.isnan(c), b, c)
got2, ref2 = finalize(dev.fused_raw_stats(c2, b).tolist()), stats_torch(c2, b)
out["max_pos"] = [got2["max_pos"], ref2["max_pos"]]
out["hist_equal"] = got2["hist"] == ref2["hist"] and got["hist"] == ref["hist"]
# all-finite outputs take the kernel's fast path (no masks on full tiles, a partial last tile, ties at
# the maximum resolved to the first position); fp32 rows and padded rows too; its running state per row
# and per element (ew)
fast = []
for shape, dt, valid in (((9001,), torch.bfloat16, None), ((77, 130), torch.float32, 70)):
    b3 = torch.randn(shape, generator=g).to(dt)
    c3 = (b3.float() + (torch.rand(shape, generator=g) < 0.3) * 0.25).to(dt)
    v3 = torch.tensor([valid], dtype=torch.int32) if valid else None
    r3 = stats_torch(c3, b3, valid * shape[1] if valid else None)
    for ew in (False, True):
        g3 = finalize(dev.fused_raw_stats(c3, b3, v3, ew=ew).tolist())
        fast.append(all(math.isclose(g3[k], r3[k], rel_tol=1e-6) if isinstance(r3[k], float) else g3[k] == r3[k]
                        for k in r3))
out["fast_path_equal"] = fast
# a zero baseline under a nonzero difference: the fast path's d / |b| is infinite there, so the program is
# redone exactly (|b| floored at TINY: a finite max rel)
b4 = torch.randn(3000, generator=g)
b4[::7] = 0.0
c4 = b4 + 0.25
g4, r4 = finalize(dev.fused_raw_stats(c4, b4).tolist()), stats_torch(c4, b4)
out["zero_base"] = [g4["max_rel"], r4["max_rel"]]

def base(x, w): return x.float() @ w.float()
scale = torch.ones(1)
def cand(x, w): return (x.half().float() @ w.float()) * scale
x = torch.randn(16, 32, generator=g); w = torch.randn(32, 8, generator=g)
meta = torch.tensor([2, 16, 300])
bk = Bucket(batch_size=2, draft_tokens=16, prefix_len=300, heads=4, valid_rows=torch.tensor([12], dtype=torch.int32),
            meta=meta)
rt = HookRuntime(HookConfig(mode="validate", sampling=Sampling(2)), sink=lambda s: None)
ds = rt.device(); ds.use_timer = False
s = ShadowSite("t", base, cand, runtime=rt)
for _ in range(4):
    o = s(x, w, layer=0, bucket=bk)
    assert torch.equal(o, base(x, w))
recs = ds.poll()
out["eager_steps"] = [r["step"] for r in recs]
out["eager_numel"] = recs[0]["numel"]
out["eager_bucket"] = [recs[0]["batch_size"], recs[0]["draft_tokens"], recs[0]["prefix_len"], recs[0]["heads"]]
out["eager_max_abs_ok"] = math.isclose(recs[0]["max_abs"], stats_torch(cand(x, w), base(x, w), 96)["max_abs"],
                                       rel_tol=1e-6)
CAPTURE[0] = True  # from here the kernels decide, as on graph replay
for _ in range(4):
    s(x, w, layer=0, bucket=bk)
out["device_steps"] = [r["step"] for r in ds.poll()]
# a replay of a batch that is all padding (its meta reads 0 real requests): nothing to compare, no sample; the
# next real batch is sampled again
meta[0] = 0
for _ in range(4):
    s(x, w, layer=0, bucket=bk)
out["empty_batch_records"] = len(ds.poll())
meta[0] = 2
for _ in range(2):
    s(x, w, layer=0, bucket=bk)
out["after_empty_batch"] = [[r["batch_size"], r["numel"]] for r in ds.poll()]
rt.set_override("off")
for _ in range(4):
    s(x, w, layer=0, bucket=bk)
out["kill_switch_records"] = len(ds.poll())
rt2 = HookRuntime(HookConfig(mode="on", spot_every=2), sink=lambda s: None)
ds2 = rt2.device(); ds2.use_timer = False
s2 = ShadowSite("t2", base, cand, runtime=rt2)
res = []
for i in range(6):
    if i == 3:
        scale.fill_(3.0)
    o = s2(x, w, layer=0, bucket=bk)
    res.append("cand" if torch.equal(o, cand(x, w)) else "base" if torch.equal(o, base(x, w)) else "?")
    ds2.poll()
out["on_outputs"] = res
out["fallback"] = rt2.fallback
# under a graph every on-mode call is checked: a candidate going bad between spot checks (call 3)
# is caught on that very call, reported, and never served
scale.fill_(1.0)
rt3 = HookRuntime(HookConfig(mode="on", spot_every=2), sink=lambda s: None)
ds3 = rt3.device(); ds3.use_timer = False
s3 = ShadowSite("t3", base, cand, runtime=rt3)
res3 = []
for i in range(6):
    if i == 2:
        scale.fill_(3.0)
    o = s3(x, w, layer=0, bucket=bk)
    res3.append("cand" if torch.equal(o, cand(x, w)) else "base" if torch.equal(o, base(x, w)) else "?")
    recs3 = ds3.poll()
    if recs3:
        out.setdefault("between_spot_records", []).extend([r["step"] for r in recs3])
out["between_spot_outputs"] = res3
# on mode with a baseline gate (as the SGLang site has): the baseline reads its work size through
# device memory that the gate zeroes on replays that are neither spot checks nor fallbacks
import contextlib

scale.fill_(1.0)
SIZES = [torch.tensor([5, 7], dtype=torch.int64)]
seen = []
def base_sized(x, w):
    seen.append(int(SIZES[0][0]))
    return base(x, w)
@contextlib.contextmanager
def gate(sstate, args, kwargs):
    real = SIZES[0]
    SIZES[0] = dev.gated_copy(real, sstate)
    try:
        yield
    finally:
        SIZES[0] = real
rt4 = HookRuntime(HookConfig(mode="on", spot_every=2), sink=lambda s: None)
ds4 = rt4.device(); ds4.use_timer = False
s4 = ShadowSite("t4", base_sized, cand, runtime=rt4, baseline_gate=gate)
res4 = []
for i in range(6):
    if i == 2:
        scale.fill_(3.0)
    o = s4(x, w, layer=0, bucket=bk)
    res4.append("cand" if torch.equal(o, cand(x, w)) else "base" if torch.equal(o, base(x, w)) else "?")
out["gated_outputs"] = res4
out["gated_sizes_seen"] = list(seen)
out["gated_records"] = [r["step"] for r in ds4.poll()]
# validate under a graph with a candidate gate (as the SGLang site has): the candidate reads its work size
# through device memory that the gate zeroes on unsampled replays and once the kill switch is off
csizes = []
def base_n(x, w, n): return base(x, w)
def cand_n(x, w, n):
    csizes.append(int(n[0]))
    return cand(x, w)
def cgate(sstate, args, kwargs):
    return (args[0], args[1], dev.gated_copy(args[2], sstate, dev.RUN_CAND)), kwargs
rt5 = HookRuntime(HookConfig(mode="validate", sampling=Sampling(2)), sink=lambda s: None)
ds5 = rt5.device(); ds5.use_timer = False
s5 = ShadowSite("t5", base_n, cand_n, runtime=rt5, candidate_gate=cgate)
nsz = torch.tensor([7, 3], dtype=torch.int64)
returned = [torch.equal(s5(x, w, nsz, layer=0, bucket=bk), base(x, w)) for _ in range(4)]
recs5 = ds5.poll()
# the kill switch as a replay sees it: only the control word changes (no Python runs on replay), pushed to
# the device mirror the control kernel reads
ds5.hctrl[0] = 0
assert ds5.push_control()
for _ in range(2):
    s5(x, w, nsz, layer=0, bucket=bk)
out["cand_gate"] = {"sizes": csizes, "records": len(recs5), "baseline_returned": returned,
                    "nsz_untouched": nsz.tolist() == [7, 3], "after_kill_records": len(ds5.poll())}
# oracle sampling on the device path (eager validate, 1 in 2 sampled calls): candidate vs oracle and baseline
# vs oracle as ring records of their own, merged into their call's sample (real rows only)
CAPTURE[0] = False  # eager calls only
def oracle_fn(x, w): return (x.double() @ w.double()).float()
rt6 = HookRuntime(HookConfig(mode="validate", sampling=Sampling(1), oracle_every=2), sink=lambda s: None)
ds6 = rt6.device(); ds6.use_timer = False
s6 = ShadowSite("t6", base, cand, oracle=oracle_fn, runtime=rt6)
returned6 = [torch.equal(s6(x, w, layer=0, bucket=bk), base(x, w)) for _ in range(4)]
recs6 = ds6.poll()
ref6 = oracle_fn(x, w).reshape(-1)[:96]
out["oracle"] = {"returned": returned6, "n": len(recs6), "cand": [r["oracle_cand_err"] for r in recs6],
                 "base": [r["oracle_base_err"] for r in recs6],
                 "cand_ref": float((cand(x, w).reshape(-1)[:96] - ref6).abs().max()),
                 "base_ref": float((base(x, w).reshape(-1)[:96] - ref6).abs().max()),
                 "errors": s6.errors}
# the hook's own failure (a launch of its kernels, a site's gate) never reaches the caller: the baseline's
# result is served and the candidate disabled; what the baseline raises still reaches the caller
import shadowd.hook.cuda_call as cc

samples7 = []
rt7 = HookRuntime(HookConfig(mode="validate", sampling=Sampling(1)), sink=samples7.append)
ds7 = rt7.device(); ds7.use_timer = False
s7 = ShadowSite("t7", base, cand, runtime=rt7)
real_launch = cc.launch_stats
def broken_launch(*a, **k): raise RuntimeError("launch failed")
cc.launch_stats = broken_launch
try:
    o7 = s7(x, w, layer=0, bucket=bk)
finally:
    cc.launch_stats = real_launch
after7 = s7(x, w, layer=0, bucket=bk)
out["hook_failure"] = {"returned": torch.equal(o7, base(x, w)), "disabled": rt7.disabled,
                       "reason": rt7.disabled_reason, "after": torch.equal(after7, base(x, w)),
                       "samples": [s["error"] for s in samples7]}
def bad_base(x, w): raise ValueError("baseline says no")
rt8 = HookRuntime(HookConfig(mode="validate", sampling=Sampling(1)), sink=lambda s: None)
ds8 = rt8.device(); ds8.use_timer = False
try:
    ShadowSite("t8", bad_base, cand, runtime=rt8)(x, w, layer=0, bucket=bk)
    out["baseline_error"] = None
except ValueError as e:
    out["baseline_error"] = str(e)
out["baseline_error_disabled"] = rt8.disabled
@contextlib.contextmanager
def bad_gate(sstate, args, kwargs):
    raise RuntimeError("gate broke")
    yield
base_calls = []
def counted_base(x, w):
    base_calls.append(1)
    return base(x, w)
rt9 = HookRuntime(HookConfig(mode="on", spot_every=2), sink=lambda s: None)
ds9 = rt9.device(); ds9.use_timer = False
s9 = ShadowSite("t9", counted_base, cand, runtime=rt9, baseline_gate=bad_gate)
CAPTURE[0] = True
o9 = s9(x, w, layer=0, bucket=bk)
CAPTURE[0] = False
out["gate_failure"] = {"returned": torch.equal(o9, base(x, w)), "disabled": rt9.disabled, "base_calls": len(base_calls)}
# a first CUDA call under capture cannot create the device state (it would live in the graph's pool)
rt10 = HookRuntime(HookConfig(mode="validate", sampling=Sampling(1)), sink=lambda s: None)
s10 = ShadowSite("t10", base, cand, runtime=rt10)
CAPTURE[0] = True
o10 = s10(x, w, layer=0, bucket=bk)
CAPTURE[0] = False
o10b = s10(x, w, layer=0, bucket=bk)  # disabled: baseline only, no device state made afterwards either
out["first_call_captured"] = {"returned": torch.equal(o10, base(x, w)) and torch.equal(o10b, base(x, w)),
                              "disabled": rt10.disabled, "reason": rt10.disabled_reason, "device": rt10.has_device}
# a push does not hold the word's lock while it launches: another thread's write during it (the kill switch
# arriving while a push compiles its kernel, say) neither waits nor is lost
import threading

real_mirror = dev.mirror_kernel
class SlowMirror:
    writer_finished = None
    raced = False
    def __getitem__(self, grid):
        def launch(*a, **k):
            if not self.raced:  # the first launch only: the writer's own push launches plainly
                self.raced = True
                t = threading.Thread(target=rt11.set_override, args=("off",))
                t.start()
                t.join(10)
                self.writer_finished = not t.is_alive()
            return real_mirror[grid](*a, **k)
        return launch
rt11 = HookRuntime(HookConfig(mode="validate", sampling=Sampling(1)), sink=lambda s: None)
ds11 = rt11.device()
slow = SlowMirror()
dev.mirror_kernel = slow
first11 = ds11.push_control()
dev.mirror_kernel = real_mirror
out["push_race"] = {"first": first11, "writer_finished": slow.writer_finished, "dirty": ds11.control_dirty,
                    "mirror_is_word": int(ds11.dctrl[0]) == int(ds11.hctrl[0]), "mode": int(ds11.dctrl[0]) & 3}
# the candidate's own error word (``candidate_flag``: mla_tree_verify's error_flag) read by the statistics kernel into
# the call's record: a raised word is a candidate error that disables the candidate (validate); in on mode under a
# graph the call whose check sees it serves the baseline and the device falls back at once
scale.fill_(1.0)
def flagging(bits):
    """A candidate that raises ``bits`` in its error word on its third call: (candidate, word, calls)."""
    word, calls = torch.zeros(1, dtype=torch.int32), []
    def candidate(x, w):
        calls.append(1)
        if len(calls) == 3:
            word.fill_(bits)
        return cand(x, w)
    return candidate, word, calls
cand_flagging, FLAG, calls12 = flagging(4)
rt12 = HookRuntime(HookConfig(mode="validate", sampling=Sampling(1)), sink=lambda s: None)
ds12 = rt12.device(); ds12.use_timer = False
s12 = ShadowSite("t12", base, cand_flagging, runtime=rt12, candidate_flag=lambda d: FLAG,
                 describe_flag=lambda v: f"bits {v}")
ret12, recs12 = [], []
for _ in range(4):
    ret12.append(torch.equal(s12(x, w, layer=0, bucket=bk), base(x, w)))
    recs12 += ds12.poll()
out["flag_validate"] = {"returned": ret12, "errors": [r["error"] for r in recs12], "disabled": rt12.disabled,
                        "reason": rt12.disabled_reason, "cand_calls": len(calls12),
                        "device_errors": rt12.producer_stats()["device_errors"]}
cand_flagging2, FLAG2, _calls13 = flagging(1)
rt13 = HookRuntime(HookConfig(mode="on", spot_every=2), sink=lambda s: None)
ds13 = rt13.device(); ds13.use_timer = False
s13 = ShadowSite("t13", base, cand_flagging2, runtime=rt13, candidate_flag=lambda d: FLAG2)
res13, errs13 = [], []
for i in range(4):
    CAPTURE[0] = i > 0  # the first call eager (checked: a first output shape), then the kernels decide
    o = s13(x, w, layer=0, bucket=bk)
    res13.append("cand" if torch.equal(o, cand(x, w)) else "base" if torch.equal(o, base(x, w)) else "?")
    errs13 += [r["error"] for r in ds13.poll()]
CAPTURE[0] = False
out["flag_on"] = {"outputs": res13, "fallback": rt13.fallback, "reason": rt13.fallback_reason, "errors": errs13,
                  "disabled": rt13.disabled}
# on mode with a baseline gate: a word raised by a call between spot checks (its output served unchecked) makes the
# next replay a check: the baseline serves it, and the device falls back at once (no spot check in these 6 steps)
cand_flagging3, FLAG3, _calls14 = flagging(2)
rt14 = HookRuntime(HookConfig(mode="on", spot_every=1000), sink=lambda s: None)
ds14 = rt14.device(); ds14.use_timer = False
SIZES[0] = torch.tensor([5, 7], dtype=torch.int64)
seen14 = len(seen)
s14 = ShadowSite("t14", base_sized, cand_flagging3, runtime=rt14, baseline_gate=gate, candidate_flag=lambda d: FLAG3)
res14, errs14 = [], []
for i in range(6):
    CAPTURE[0] = i > 0
    o = s14(x, w, layer=0, bucket=bk)
    res14.append("cand" if torch.equal(o, cand(x, w)) else "base" if torch.equal(o, base(x, w)) else "?")
    errs14 += [r["error"] for r in ds14.poll()]
CAPTURE[0] = False
out["flag_gated"] = {"outputs": res14, "sizes": seen[seen14:], "fallback": rt14.fallback,
                     "reason": rt14.fallback_reason, "errors": errs14}
# eager on mode between spot checks: the word raised by an unchecked call reaches the host through the pinned copy
# made after the step's first call (here each call is a step), and the calls after it serve the baseline
cand_flagging4, FLAG4, calls15 = flagging(8)
rt15 = HookRuntime(HookConfig(mode="on", spot_every=1000), sink=lambda s: None)
ds15 = rt15.device(); ds15.use_timer = False
s15 = ShadowSite("t15", base, cand_flagging4, runtime=rt15, candidate_flag=lambda d: FLAG4)
res15 = []
for _i in range(5):
    o = s15(x, w, layer=0, bucket=bk)
    res15.append("cand" if torch.equal(o, cand(x, w)) else "base" if torch.equal(o, base(x, w)) else "?")
out["flag_eager_on"] = {"outputs": res15, "fallback": rt15.fallback, "reason": rt15.fallback_reason,
                        "disabled": rt15.disabled, "cand_calls": len(calls15),
                        "device_errors": rt15.producer_stats()["device_errors"]}
# on mode with a baseline gate: a served candidate output holding a NaN in a real row (a call between spot checks)
# makes the layer's next replay a spot check, which catches the candidate's non-finite output and falls back; a NaN
# in a padded row (beyond valid_rows) is nobody's output and changes nothing
def nan_from_third_call(row, words=None):
    """A candidate whose output holds a NaN at ``row`` from its third call on (raising ``words[1]``, its non-finite
    output word, when given)."""
    calls = []
    def candidate(x, w):
        calls.append(1)
        o = cand(x, w)
        if len(calls) >= 3:
            o = o.clone()
            o[row, 1] = float("nan")
            NAN_ON[0] = True
            if words is not None:
                words[1] = 1
        return o
    return candidate
def served(o):
    """Which output a call served, over the real rows."""
    o = o[:12]
    return ("cand" if torch.equal(o, cand(x, w)[:12]) else "nan" if bool(o.isnan().any())
            else "base" if torch.equal(o, base(x, w)[:12]) else "?")
NAN_ON = [False]  # raised by nan_from_third_call's third call: a baseline that reads it makes the same NaN
def base_nan(x, w):
    o = base_sized(x, w)
    if NAN_ON[0]:
        o = o.clone()
        o[4, 1] = float("nan")
    return o
def nan_run(row, baseline=base_sized, calls=6):
    rt16 = HookRuntime(HookConfig(mode="on", spot_every=1000), sink=lambda s: None)
    ds16 = rt16.device(); ds16.use_timer = False
    SIZES[0] = torch.tensor([5, 7], dtype=torch.int64)
    seen16 = len(seen)
    NAN_ON[0] = False
    s16 = ShadowSite("t16", baseline, nan_from_third_call(row), runtime=rt16, baseline_gate=gate)
    res16, recs16 = [], []
    for i in range(calls):
        CAPTURE[0] = i > 0
        res16.append(served(s16(x, w, layer=0, bucket=bk)))
        recs16 += ds16.poll()
    CAPTURE[0] = False
    return {"outputs": res16, "sizes": seen[seen16:], "fallback": rt16.fallback,
            "records": [[r["cand_nonfinite"], r["nan_base"]] for r in recs16]}
# (in each run below the first, eager call is checked: the site has not seen its output's shape yet)
out["nan_gated"] = nan_run(4)
# a NaN the baseline makes too (the model's own): the triggered spot check finds no mismatch, the candidate stays, and
# the checked call's NaN (compared, the baseline's too) triggers nothing: one check per unchecked NaN, not every call
out["nan_legit"] = nan_run(4, base_nan, 7)
# eager on mode, no spot check in sight: the candidate's second word (its non-finite output word, as mla_tree_verify's
# nonfinite_flag) comes to the host with the per-step copy; once seen, the next step is checked whole (here one layer
# per step: the step after the one that saw it), which catches the NaN and falls back
WORDS = torch.zeros(2, dtype=torch.int32)
rt18 = HookRuntime(HookConfig(mode="on", spot_every=1000), sink=lambda s: None)
ds18 = rt18.device(); ds18.use_timer = False
s18 = ShadowSite("t18", base, nan_from_third_call(4, WORDS), runtime=rt18, candidate_flag=lambda d: WORDS)
res18, recs18 = [], []
for _i in range(6):
    res18.append(served(s18(x, w, layer=0, bucket=bk)))
    recs18 += ds18.poll()
out["nan_word_eager"] = {"outputs": res18, "fallback": rt18.fallback, "disabled": rt18.disabled,
                         "records": [[r["cand_nonfinite"], r["error"]] for r in recs18], "word": WORDS.tolist()}
out["nan_padded"] = nan_run(14)
# a layer's device state (decision words, accumulator) is made by its first eager call, even an unchecked on-mode
# one that runs no hook kernel: made under graph capture it would come from the graph's pool (zero-filled on every
# replay, freed with the graph)
rt17 = HookRuntime(HookConfig(mode="on", spot_every=1000), sink=lambda s: None)
ds17 = rt17.device(); ds17.use_timer = False
s17 = ShadowSite("t17", base, cand, runtime=rt17)
o0 = s17(x, w, layer=0, bucket=bk)
made17 = (id(s17), 0) in ds17.slots
CAPTURE[0] = True
o1 = s17(x, w, layer=0, bucket=bk)
CAPTURE[0] = False
out["slot_eager"] = {"made": made17, "unchecked": torch.equal(o0, cand(x, w)), "l0": torch.equal(o1, cand(x, w))}
# on mode under a graph with both gates (as the SGLang site has): one gate launch per replay makes the baseline's and
# the candidate's work-size copies; the candidate works on the replays that serve or check it, and does nothing while
# the kill switch or a fall-back has the baseline serve (the ring is read only at the end: no Python learns of the
# fall-back, as on a real replay)
import shadowd.hook.launch as launch_mod

real_gate = launch_mod.gate_kernel
gate_counts = []
class CountingGate:
    def __getitem__(self, grid):
        def launch(*a, **k):
            gate_counts.append(k["COUNT"])
            return real_gate[grid](*a, **k)
        return launch
launch_mod.gate_kernel = CountingGate()
scale.fill_(1.0)
SIZES[0] = torch.tensor([5, 7], dtype=torch.int64)
seen19, csizes19 = len(seen), []
def base19(x, w, n): return base_sized(x, w)
def cand19(x, w, n):
    csizes19.append(int(n[0]))
    return cand(x, w)
rt19 = HookRuntime(HookConfig(mode="on", spot_every=2), sink=lambda s: None)
ds19 = rt19.device(); ds19.use_timer = False
s19 = ShadowSite("t19", base19, cand19, runtime=rt19, baseline_gate=gate, candidate_gate=cgate)
res19, launches19 = [], []
word19 = int(ds19.hctrl[0])
for i in range(10):
    CAPTURE[0] = i > 0
    if i == 3:  # the kill switch as a replay sees it: the device word says off
        ds19.hctrl[0] = 0
        assert ds19.push_control()
    if i == 5:
        ds19.hctrl[0] = word19
        assert ds19.push_control()
    if i == 6:
        scale.fill_(3.0)  # the candidate goes wrong: served unchecked at step 7, caught by step 8's spot check
    before = len(gate_counts)
    o = s19(x, w, nsz, layer=0, bucket=bk)
    launches19.append(gate_counts[before:])
    res19.append("cand" if torch.equal(o, cand(x, w)) else "base" if torch.equal(o, base(x, w)) else "?")
CAPTURE[0] = False
launch_mod.gate_kernel = real_gate
ds19.poll()
scale.fill_(1.0)
out["both_gates"] = {"outputs": res19, "base_sizes": seen[seen19:], "cand_sizes": csizes19,
                     "launches": launches19, "fallback": rt19.fallback}
# on mode on the shapes a promotion gate's verdict covered (here [batch 2, tree 16, prefix bucket 9]: 256-511 tokens):
# the control kernel checks each replay's shape, read from device memory, against the bitmap the gate pushed
from shadowd.hook.coverage import Coverage

rt20 = HookRuntime(HookConfig(mode="on", spot_every=1000), sink=lambda s: None)
ds20 = rt20.device(); ds20.use_timer = False
s20 = ShadowSite("t20", base, cand, runtime=rt20)
s20(x, w, layer=0, bucket=bk)  # eager and checked (a first output)
rt20.open_gate("test", Coverage.from_buckets([[2, 16, 9]]))
res20 = []
CAPTURE[0] = True
for plen in (300, 600, 511, 256, 255):
    meta[2] = plen
    res20.append("cand" if torch.equal(s20(x, w, layer=0, bucket=bk), cand(x, w)) else "base")
meta[2] = 300
meta[0] = 3  # a batch of three: bucket 4, not covered
res20.append("cand" if torch.equal(s20(x, w, layer=0, bucket=bk), cand(x, w)) else "base")
meta[0] = 2
# a later READY verdict covers prefixes of 512-1023 tokens too: the bitmap on the device widens, the next replay of
# a 600-token prefix gets the candidate
widened = rt20.widen_coverage(Coverage.from_buckets([[2, 16, 10]]))
meta[2] = 600
res20.append("cand" if torch.equal(s20(x, w, layer=0, bucket=bk), cand(x, w)) else "base")
meta[2] = 300
CAPTURE[0] = False
ds20.poll()
out["coverage"] = {"outputs": res20, "bitmap_word": int(ds20.cov[1 * 32 + 4]), "fallback": rt20.fallback,
                   "widened": widened,
                   "on_calls": rt20.on_calls, "device_on_calls": rt20.device_on_calls,
                   "stats": {k: v for k, v in rt20.producer_stats().items() if k.startswith("on_")}}
print("RESULT " + json.dumps(out))
