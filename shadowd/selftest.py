"""``shadowd selftest``: step 1 of the cutover, on the GPU the candidate will serve.

Builds the candidate kernel, runs it against the float64 oracle over a shape sweep (batches
with mixed prefix lengths including 0 and 1, tree sizes 1..257, heads 1..128, random / chain /
star trees and causal masks, unit and peaky logits), compares it with SGLang's Triton kernel
where that is importable (the FlashAttention rule with a bf16-ulp floor, else a fixed bf16
tolerance; cosine difference ≤ 5e-6 always; non-finite positions equal the oracle's), times
both, and passes only when every case passes.

The sweep itself is device-agnostic: ``run_selftest`` takes the candidate as a function, so the
same code is exercised on the CPU with a CPU implementation.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["CaseResult", "SelftestReport", "default_sweep", "run_selftest", "selftest_main"]

Candidate = Callable[..., torch.Tensor]


@dataclass
class CaseResult:
    desc: str
    passed: bool
    info: dict[str, Any]
    cand_us: float | None = None
    triton_us: float | None = None
    error: str | None = None


@dataclass
class SelftestReport:
    device: str
    results: list[CaseResult] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.results) and all(r.passed for r in self.results)


def default_sweep(quick: bool = False, max_prefix: int = 3000, seed: int = 7) -> list[dict[str, Any]]:
    """The sweep's case specs (``mla_tree_verify.testing.make_case`` keyword sets)."""
    from mla_tree_verify import testing

    fixed: list[dict[str, Any]] = [
        {"prefix_lens": [0, 1, 37], "tree_sizes": [1, 8, 16], "heads": 8, "tree_kind": "random"},
        {"prefix_lens": [4096], "tree_sizes": [257], "heads": 8, "tree_kind": "wide"},
        {"prefix_lens": [2048, 0], "tree_sizes": [64, 64], "heads": 64, "tree_kind": "chain"},
        {"prefix_lens": [1000], "tree_sizes": [16], "heads": 128, "tree_kind": "star", "logit_std": 8.0},
        {"prefix_lens": [513, 9], "tree_sizes": [13, 7], "heads": 16, "use_mask": False},
    ]
    if quick:
        return fixed[:3]
    return fixed + testing.random_case_specs(seed, 12, max_prefix=max_prefix)


def _time_us(fn: Callable[[], Any], device: torch.device, reps: int = 10) -> float:
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps * 1e6
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def _bind(fn: Candidate, case: Any) -> Callable[[], Any]:
    def call() -> Any:
        return fn(*case.args(), max_q_len=case.max_q_len)

    return call


def _words_raised(err: torch.Tensor, nonfinite: torch.Tensor, out: torch.Tensor) -> str | None:
    """What the candidate's own words say about a valid case whose output the pass rule accepted (None: nothing):
    an error bit on valid input would disable the candidate in serving, a non-finite word over a finite output would
    make the hook check calls for nothing."""
    bits, nf = int(err.item()), int(nonfinite.item())
    if bits:
        return f"error_flag 0x{bits:x} raised on valid input"
    if nf and bool(torch.isfinite(out).all()):
        return "nonfinite_flag raised over a finite output"
    return None


def run_selftest(candidate: Candidate, device: str | torch.device, specs: list[dict[str, Any]],
                 echo: Callable[[str], None] = print, use_triton: bool | None = None,
                 time_it: bool = True, words: bool = False) -> SelftestReport:
    """Run ``candidate`` (tree_verify's signature) over ``specs`` against the oracle (and Triton). ``words``: also
    hand it ``error_flag`` and ``nonfinite_flag`` (int32 [1] each, as the SGLang site does) and fail a case that
    raises either on its valid, finite inputs."""
    from mla_tree_verify import oracle, testing

    dev = torch.device(device)
    if use_triton is None:
        use_triton = dev.type == "cuda" and testing.sglang_triton_available()
    report = SelftestReport(device=str(dev))
    for i, spec in enumerate(specs, 1):
        case = testing.make_case(**{"seed": i, **spec}, device=dev)
        try:
            ref = oracle.attention(*case.args(), dtype=torch.float64)
            extra = ({"error_flag": torch.zeros(1, dtype=torch.int32, device=dev),
                      "nonfinite_flag": torch.zeros(1, dtype=torch.int32, device=dev)} if words else {})
            out = candidate(*case.args(), max_q_len=case.max_q_len, **extra)
            tri = testing.run_sglang_triton(case) if use_triton else None
            ok, info = testing.pass_rule(out, ref, tri)
            raised = _words_raised(extra["error_flag"], extra["nonfinite_flag"], out) if words else None
            res = CaseResult(case.desc, ok and raised is None, info, error=raised)
            if time_it:
                res.cand_us = _time_us(_bind(candidate, case), dev)
                if use_triton:
                    res.triton_us = _time_us(functools.partial(testing.run_sglang_triton, case), dev)
        except Exception as exc:  # a crashing case is a failed case, reported, and the sweep goes on
            res = CaseResult(case.desc, False, {}, error=f"{type(exc).__name__}: {exc}")
        report.results.append(res)
        echo(_line(i, len(specs), res))
    return report


def _line(i: int, n: int, r: CaseResult) -> str:
    status = "PASS" if r.passed else "FAIL"
    if r.error:
        return f"[{i:2d}/{n}] {status} {r.desc}: {r.error}"
    timing = ""
    if r.cand_us is not None:
        timing = f"  cand {r.cand_us:9.1f} µs"
        if r.triton_us is not None:
            timing += f"  triton {r.triton_us:9.1f} µs  ×{r.triton_us / max(r.cand_us, 1e-9):6.1f}"
    nan = float("nan")
    errs = f"max|c-o| {r.info.get('cand_max_abs', nan):.2e} relL2 {r.info.get('cand_rel_l2', nan):.2e}"
    return f"[{i:2d}/{n}] {status} {r.desc}  {errs}{timing}"


def selftest_main(quick: bool = False, seed: int = 7, echo: Callable[[str], None] = print,
                  sanitize: bool = False, sanitize_timeout_s: float = 900.0) -> int:
    """The CLI: 0 when every case passes on this machine's GPU, 1 when any fails (or the kernel's build targets
    have no code for this GPU), 2 without CUDA. ``sanitize``: then also run compute-sanitizer's four tools over the
    kernel's representative launches on this GPU (:mod:`shadowd.sanitize`, each tool limited to
    ``sanitize_timeout_s``); 0 only when every tool is clean too."""
    if not torch.cuda.is_available():
        echo("selftest needs a CUDA GPU: run it on the machine the candidate will serve on")
        return 2
    import os

    import mla_tree_verify
    from mla_tree_verify import _lib

    name = torch.cuda.get_device_name()
    cap = torch.cuda.get_device_capability()
    prebuilt = os.environ.get("MLA_TREE_VERIFY_LIB")
    echo(f"GPU: {name} (sm_{cap[0]}{cap[1]}); "
         + (f"the prebuilt kernel library {prebuilt} (MLA_TREE_VERIFY_LIB)" if prebuilt
            else "building the kernel (cached after the first time)..."))
    from mla_tree_verify import _build

    if not prebuilt and not _build.runs_on(cap):  # (a prebuilt library may have been built for other targets)
        echo(f"{name} is sm_{cap[0]}{cap[1]}: mla_tree_verify is built for {_build.targets()}, which have no code "
             "for this GPU (set MLA_TREE_VERIFY_LIB to a library built for it)")
        return 1
    try:  # the library the candidate will load, as it loads it (a prebuilt one too): that is what is tested
        lib = _lib.load()
        echo(f"kernel library: {lib._name}")
    except (RuntimeError, OSError) as exc:
        echo(f"kernel library unavailable: {exc}")
        return 1
    report = run_selftest(mla_tree_verify.tree_verify, "cuda", default_sweep(quick, seed=seed), echo, words=True)
    failed = [r for r in report.results if not r.passed]
    echo(f"{len(report.results) - len(failed)}/{len(report.results)} cases passed on {name}")
    clean = True
    if sanitize:
        from shadowd.sanitize import sanitize as run_sanitizers

        clean = run_sanitizers(echo, timeout_s=sanitize_timeout_s)
        echo(f"compute-sanitizer on {name}: " + ("every tool clean" if clean else "FAILED (above)"))
    return 0 if report.passed and clean else 1
