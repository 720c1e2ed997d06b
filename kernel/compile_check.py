"""``python -m mla_tree_verify.compile_check``: compile-only resource check (no GPU needed).

Compiles csrc/ with ``nvcc -Xptxas -v`` for sm_120 (the target) and sm_90, parses ptxas'
report and prints registers / static smem / dynamic smem / stack / spills per kernel.  Fails
(exit 1, naming the kernel and the figure) if an sm_120 kernel spills registers, uses a stack
frame, or needs more than 101376 bytes of shared memory per block (static + dynamic).
Exit 2 if nvcc is missing or the compile fails.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ._build import BASE_FLAGS, CSRC, MAIN_SOURCE, extra_flags, find_nvcc

SM120_SMEM_LIMIT = 101376
# kernels launched with dynamic shared memory -> name of the C ABI getter of its size
DYNAMIC_SMEM_KERNELS = {f"mtv_fwd_kernel<{g},{split}>" for g in (2, 4) for split in (0, 1)}


@dataclass
class KernelReport:
    arch: str
    kernel: str
    registers: int = 0
    static_smem: int = 0
    dynamic_smem: int = 0
    stack: int = 0
    spill_stores: int = 0
    spill_loads: int = 0

    @property
    def smem_total(self) -> int:
        return self.static_smem + self.dynamic_smem


def demangle(name: str) -> str:
    """``_ZN3mtv14mtv_fwd_kernelILi4ELi1EEEv7MtvArgs`` -> ``mtv_fwd_kernel<4,1>`` (mtv:: names, int template
    args)."""
    m = re.match(r"_ZN(?:\d+\w+?)*?3mtv(\d+)", name)
    if m:
        n = int(m.group(1))
        base = name[m.end() : m.end() + n]
        args = re.match(r"I((?:Li-?\d+E)+)E", name[m.end() + n :])
        if args:
            base += "<" + ",".join(re.findall(r"Li(-?\d+)E", args.group(1))) + ">"
        return base
    return name


def parse_ptxas(text: str) -> list[KernelReport]:
    """Parse ``-Xptxas -v`` output into one report per (kernel, arch)."""
    reports: list[KernelReport] = []
    cur: KernelReport | None = None
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '([^']+)' for '(sm_\d+a?)'", line)
        if m:
            cur = KernelReport(arch=m.group(2), kernel=demangle(m.group(1)))
            reports.append(cur)
            continue
        if cur is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            cur.stack, cur.spill_stores, cur.spill_loads = (int(x) for x in m.groups())
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m:
            cur.registers = int(m.group(1))
            s = re.search(r"(\d+) bytes smem", line)
            cur.static_smem = int(s.group(1)) if s else 0
    return reports


def dynamic_smem_bytes(nvcc: str) -> int:
    """Compile and run a host-only program printing the kernel's dynamic smem constant."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "smem.cu"
        src.write_text(
            '#include <cstdio>\n#include "tree_verify_fwd.cuh"\n'
            'int main() { std::printf("%d\\n", mtv::SMEM_BYTES); return 0; }\n'
        )
        exe = Path(tmp) / "smem"
        cmd = [
            nvcc,
            "-std=c++17",
            "-arch=sm_120",
            *extra_flags(),
            f"-I{CSRC}",
            f"-I{CSRC / 'common'}",
            "-o",
            str(exe),
            str(src),
        ]
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        return int(subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.strip())


def compile_reports(nvcc: str, archs: tuple[str, ...] = ("120", "90")) -> list[KernelReport]:
    reports: list[KernelReport] = []
    dyn = dynamic_smem_bytes(nvcc)
    with tempfile.TemporaryDirectory() as tmp:
        for arch in archs:
            out = Path(tmp) / f"k{arch}.cubin"
            cmd = [
                nvcc,
                *BASE_FLAGS,
                *extra_flags(),
                "-cubin",
                f"-arch=sm_{arch}",
                "-Xptxas",
                "-v",
                f"-I{CSRC}",
                f"-I{CSRC / 'common'}",
                "-o",
                str(out),
                str(MAIN_SOURCE),
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"nvcc failed for sm_{arch}:\n{proc.stderr}")
            for r in parse_ptxas(proc.stdout + proc.stderr):
                if r.kernel in DYNAMIC_SMEM_KERNELS:
                    r.dynamic_smem = dyn
                reports.append(r)
    return reports


def check(reports: list[KernelReport]) -> list[str]:
    """Failures for the sm_120 build (spills, stack, smem over budget)."""
    fails = []
    for r in reports:
        if r.arch != "sm_120":
            continue
        if r.spill_stores or r.spill_loads:
            fails.append(
                f"{r.kernel} (sm_120) spills registers: {r.spill_stores} B stores, {r.spill_loads} B loads"
            )
        if r.stack:
            fails.append(f"{r.kernel} (sm_120) uses a {r.stack} B stack frame (local memory)")
        if r.smem_total > SM120_SMEM_LIMIT:
            fails.append(
                f"{r.kernel} (sm_120) needs {r.smem_total} B shared memory per block > {SM120_SMEM_LIMIT}"
            )
    if not any(r.arch == "sm_120" for r in reports):
        fails.append("no sm_120 kernels found in the ptxas report")
    return fails


def format_table(reports: list[KernelReport]) -> str:
    lines = [
        "| arch | kernel | registers | static smem B | dynamic smem B | stack B | spill st/ld B |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in reports:
        lines.append(
            f"| {r.arch} | {r.kernel} | {r.registers} | {r.static_smem} | {r.dynamic_smem} | "
            f"{r.stack} | {r.spill_stores}/{r.spill_loads} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mla_tree_verify.compile_check", description=__doc__)
    ap.add_argument("--arch", action="append", help="SM numbers to compile (default 120 and 90)")
    ns = ap.parse_args(argv)
    try:
        nvcc = find_nvcc()
    except RuntimeError as e:  # ($NVCC set to something that is not nvcc)
        print(f"compile_check: {e}", file=sys.stderr)
        return 2
    if nvcc is None:
        print("compile_check: nvcc not found (set $NVCC or $CUDA_HOME)", file=sys.stderr)
        return 2
    archs = tuple(ns.arch) if ns.arch else ("120", "90")
    if "120" not in archs:
        archs = ("120", *archs)
    try:
        reports = compile_reports(nvcc, archs)
    except (RuntimeError, subprocess.CalledProcessError) as e:
        # (nvcc's own words: an unknown flag in MLA_TREE_VERIFY_NVCC_FLAGS, a compile error)
        detail = (getattr(e, "stderr", None) or "").strip()
        print(f"compile_check: {e}" + (f"\n{detail}" if detail else ""), file=sys.stderr)
        return 2
    print(format_table(reports))
    fails = check(reports)
    for f in fails:
        print(f"FAIL: {f}", file=sys.stderr)
    if not fails:
        print(f"compile_check: OK (sm_120 limit {SM120_SMEM_LIMIT} B smem/block, no spills)")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
