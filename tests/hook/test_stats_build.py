"""The statistics kernel's default configurations compile for sm_90 and sm_120 without spilling: a compile-only
check.

Triton compiles ``_stats_kernel`` for an sm_90 target (an H100 / H200, 132 SMs) and an sm_120 target (an RTX PRO
6000 Blackwell, 188 SMs) without a GPU (its bundled ptxas), exactly as :func:`shadowd.hook.launch.stats_config`
configures it for each output size's default tile on that GPU, and the cubin's
resource usage (its bundled ``cuobjdump -res-usage``) must show no local memory: the register cap per tile
(``maxnreg``, from the programs per SM) and the per-element running state (``EW``, only where a thread may hold
255 registers) are chosen so that the pass stays in registers. One exception is measured and allowed: sm_120's
ptxas keeps one 8-byte value of the bandwidth tile (8 warps, 128 registers) on the stack across the finishing code
that runs once per program after the pass (two stores, one load); no local-memory access may sit inside a loop of
the SASS on either target, and sm_90's builds use no stack at all. The build runs in a subprocess without
``TRITON_INTERPRET`` (other tests of the suite turn the interpreter on for this process). Skipped with the reason
when Triton or its NVIDIA tools are not installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")

#: output sizes (bf16 elements) that reach each default tile and its variants: the small tile with one tile per
#: program, the mid tile, the large tile (exponent-row histogram) with and without position tracking, the bandwidth
#: tile
SIZES = (2**16, 2**20, 2**22, 2**23, 2**25)
#: (compute capability, SMs): an H100 / H200 and an RTX PRO 6000 Blackwell
TARGETS = ((90, 132), (120, 188))

SCRIPT = r'''
import json, re, subprocess, sys
from pathlib import Path

import triton
import triton.backends.nvidia as nv
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from shadowd.hook.launch import stats_config
from shadowd.hook.triton_stats import stats_kernel

out_dir, sizes, targets = Path(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3])
tools = Path(nv.__file__).parent / "bin"
if not (tools / "ptxas").exists() or not (tools / "cuobjdump").exists():
    print("RESULT " + json.dumps({"skip": f"Triton's NVIDIA tools (ptxas, cuobjdump) are not in {tools}"}))
    sys.exit(0)
sig = {"c_ptr": "*bf16", "b_ptr": "*bf16", "acc_ptr": "*i64", "accf_ptr": "*fp64", "n_static": "i32",
       "valid_ptr": "*i64", "row_numel": "i32", "sstate_ptr": "*i64", "rec_ptr": "*fp64", "seq_ptr": "*i64",
       "ring_size": "i32", "rec_size": "i32", "dstate_ptr": "*i64", "hard_scaled": "fp32", "hard_rel_l2_sq": "fp32",
       "site_id": "i32", "kind": "i32", "flag_ptr": "*i64"}
names = list(sig)
# pointers 16-byte aligned, as the JIT specializes them at launch (row_numel is in do_not_specialize)
attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in names if sig[a][0] == "*"}
res = {}
for arch, sms in targets:
    for n in sizes:
        _nprog, config = stats_config(n, 2, sms, pdl=True, stamp=True, has_valid=True, interpret=False)
        config = dict(config)
        options = {k: config.pop(k) for k in ("num_warps", "maxnreg", "launch_pdl")}
        src = ASTSource(fn=stats_kernel, signature={**sig, **dict.fromkeys(config, "constexpr")}, constexprs=config,
                        attrs=attrs)
        kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
        cubin = out_dir / f"stats-{arch}-{n}.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        usage = subprocess.run([str(tools / "cuobjdump"), "-res-usage", str(cubin)], capture_output=True, text=True,
                               check=True).stdout
        sass = subprocess.run([str(tools / "cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
        # the SASS lines that matter here: local-memory accesses and branches (loops are the backward ones)
        marks = [ln.strip() for ln in sass.splitlines() if re.search(r"\b(STL|LDL|BRA|BRX|JMP|JMX|CALL|RET)\b", ln)]
        res[f"{arch}-{n}"] = {"config": {**config, **options}, "usage": usage, "sass": marks}
print("RESULT " + json.dumps(res))
'''


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Each target's and size's configuration and ``cuobjdump -res-usage`` report, keyed ``"{arch}-{n}"``."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path_factory.mktemp("stats-build")),
                           json.dumps(SIZES), json.dumps(TARGETS)], capture_output=True, text=True, env=env,
                          timeout=600)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, proc.stdout[-2000:] + proc.stderr[-4000:]
    res: dict[str, Any] = json.loads(line[0][7:])
    if "skip" in res:
        pytest.skip(res["skip"])
    return res


@pytest.mark.parametrize("arch", [arch for arch, _ in TARGETS])
@pytest.mark.parametrize("n", SIZES)
def test_the_default_configuration_compiles_without_spills(n: int, arch: int, builds: dict[str, Any]) -> None:
    config, usage = builds[f"{arch}-{n}"]["config"], builds[f"{arch}-{n}"]["usage"]
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", usage)
    assert m, usage
    regs, stack, shared, local = (int(g) for g in m.groups())
    assert local == 0, f"{n} elements, {config}: local memory ({usage.strip()})"
    in_loops = local_accesses_in_loops(builds[f"{arch}-{n}"]["sass"])
    assert not in_loops, f"{n} elements, sm_{arch}, {config}: local memory inside a loop: {in_loops}"
    assert stack == 0 or (arch == 120 and n > 2**23 and stack <= 8), f"{n} elements, sm_{arch}: {usage.strip()}"
    assert regs <= config["maxnreg"], (regs, config)
    assert shared <= 48 * 1024, "static shared memory (the histogram's columns) within the 48 KiB default"


#: a branch instruction's target in a SASS line (the last hex number before the ``;``, not the encoding after it)
BRANCH = re.compile(r"\bBRA(?:\.\S+)?\s[^;]*?0x([0-9a-f]+)\s*;")
#: a subroutine call's target
CALL = re.compile(r"\bCALL(?:\.\S+)?\s[^;]*?0x([0-9a-f]+)\s*;")


def local_accesses_in_loops(marks: list[str]) -> list[str]:
    """The local-memory accesses (``STL`` / ``LDL``) of a kernel's SASS lines that lie inside a loop: between a
    backward branch's target and the branch, or in a subroutine (a ``CALL``'s target up to its ``RET``) called from
    inside one. An indirect branch (``BRX``, ``JMP``, ``JMX``) hides where loops are: then the whole kernel counts."""
    addr = re.compile(r"^/\*([0-9a-f]+)\*/")
    loops, local, calls, rets = [], [], [], []
    last = 0
    for ln in marks:
        m = addr.match(ln)
        if m is None:
            continue
        at = int(m.group(1), 16)
        last = max(last, at)
        if (branch := BRANCH.search(ln)) is not None:
            if int(branch.group(1), 16) <= at:
                loops.append((int(branch.group(1), 16), at))
        elif (call := CALL.search(ln)) is not None:
            calls.append((at, int(call.group(1), 16)))
        elif re.search(r"\b(BRX|JMP|JMX)\b", ln):
            loops.append((0, 2**64))
        elif re.search(r"\bRET\b", ln):
            rets.append(at)
        elif re.search(r"\b(STL|LDL)\b", ln):
            local.append((at, ln))
    grown = True
    while grown:  # subroutines called from a loop (or from such a subroutine) are part of it
        grown = False
        for at, target in calls:
            body = (target, min([r for r in rets if r >= target], default=last))
            if body not in loops and any(lo <= at <= hi for lo, hi in loops):
                loops.append(body)
                grown = True
    return [ln for at, ln in local if any(lo <= at <= hi for lo, hi in loops)]


def test_the_loop_finder_sees_a_spill_in_a_loop() -> None:
    # cuobjdump's format: the address, the instruction, and its encoding (a hex number that is not a target)
    sass = ["/*0100*/                   STL.64 [R1], R18 ;          /* 0x0000001201007387 */",
            "/*0200*/                   LDL.64 R18, [R1] ;          /* 0x0000000001127983 */",
            "/*0300*/               @P0 BRA 0x180 ;                 /* 0xfffffffc00009947 */",
            "/*0400*/                   STL [R1+0x8], R2 ;          /* 0x0000080201007387 */",
            "/*0500*/                   BRA.U !UP0, 0x500 ;         /* 0xfffffffc08007547 */",
            "/*0600*/                   BRA 0x700 ;                 /* 0x0000000000007947 */",
            "/*0700*/                   STL [R1+0x10], R3 ;         /* 0x0000100301007387 */"]
    assert local_accesses_in_loops(sass) == [sass[1]]
    assert local_accesses_in_loops([*sass[:4], "/*0500*/ BRA.U !UP0, 0x380 ;  /* 0xfffffffc08007547 */"]) == \
        [sass[1], sass[3]]
    # a subroutine called from inside a loop is inside it; called from outside, it is not
    sub = ["/*0900*/                   STL [R1+0x18], R4 ;         /* 0x0000180401007387 */",
           "/*0a00*/                   RET.REL.NODEC R20 0x0 ;     /* 0xfffffff414007950 */"]
    called = ["/*0250*/                   CALL.REL.NOINC 0x900 ;      /* 0x0000000000007944 */"]
    assert local_accesses_in_loops([*sass, *called, *sub]) == [sass[1], sub[0]]
    assert local_accesses_in_loops([*sass, "/*0650*/ CALL.REL.NOINC 0x900 ;  /* 0x0 */", *sub]) == [sass[1]]
    # an indirect branch hides the loops: every local access counts
    assert local_accesses_in_loops([*sass, "/*0800*/ BRX R2 -0x810 ;  /* 0x0 */"]) == [sass[0], sass[1], sass[3],
                                                                                          sass[6]]


def test_the_loop_finder_sees_the_loops_of_every_build(builds: dict[str, Any]) -> None:
    """Every statistics build has loops (its pass over the tiles): a local access planted at each backward branch's
    target is found inside one, so the check above cannot pass for want of loops it saw."""
    for key, b in builds.items():
        planted = []
        for ln in b["sass"]:
            at, branch = re.match(r"^/\*([0-9a-f]+)\*/", ln), re.search(BRANCH, ln)
            if at and branch and int(branch.group(1), 16) <= int(at.group(1), 16):
                planted.append(f"/*{branch.group(1)}*/ STL [R1], R0 ;")
        assert planted, f"{key}: no backward branch in the SASS"
        found = local_accesses_in_loops([*b["sass"], *planted])
        assert [ln for ln in found if ln in planted] == planted, key


def test_the_checked_sizes_cover_every_default_histogram_scheme(builds: dict[str, Any]) -> None:
    """Both shared-memory histograms the defaults use (columns, exponent rows) are among the builds checked."""
    assert {b["config"]["HIST"] for b in builds.values()} == {3, 4}
