"""compute-sanitizer runs of the candidate kernel on the GPU it will serve on (``shadowd selftest --sanitize``).

A kernel that writes out of bounds, races in shared memory or reads memory nothing wrote corrupts the inference
server's memory, and no in-process check contains that: the hook's promise stops at what the candidate returns.
Such kernels are excluded before deployment, by NVIDIA's compute-sanitizer — and on the deployment GPU itself,
because the machine code the tools check is that GPU's (the sm_120 build on an RTX PRO 6000 Blackwell is other
code than the sm_90 build the development H200 runs).

Each tool (``memcheck``, ``racecheck``, ``initcheck``, ``synccheck``) runs in a child process of its own::

    compute-sanitizer --tool T --kernel-name kns=mtv_ --print-limit 20 --error-exitcode 86 \\
        <python> -m mla_tree_verify.sanitize

(the kernel's representative launches, ``mla_tree_verify.sanitize``; only the kernel's own launches instrumented;
PyTorch's caching allocator off, so that every tensor is an allocation of its own to the tools),
with a time limit, and passes when its summary line reports nothing — ``ERROR SUMMARY: 0 errors``, or for
racecheck ``RACECHECK SUMMARY: 0 hazards displayed`` — and the launches themselves succeeded (exit 0). A tool whose
version refuses the kernel-name filter is run again checking every kernel. The executable is
``$COMPUTE_SANITIZER``, else ``compute-sanitizer`` on ``PATH``, beside ``$NVCC``, under ``$CUDA_HOME/bin`` or
``/usr/local/cuda/bin``. Every tool's whole output is kept in a log directory, named when a tool fails.

``initcheck`` is the exception to the filter (``UNFILTERED``): it instruments every kernel. What it checks — was
this byte written before it is read? — spans kernels, and the writes of a kernel the filter leaves out (PyTorch's,
which make the launches' inputs) are invisible to it: filtered, it reports every input read as uninitialized (on
an H100, 8 353 reads of one launch's inputs; unfiltered, 0 errors over every launch: bench/results). A finding in
another kernel fails the run too: PyTorch's read-back of an output the kernel left partly unwritten is where such
a hole shows.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["ERROR_EXIT", "TOOLS", "UNFILTERED", "ToolResult", "find_sanitizer", "run_tool", "sanitize"]

TOOLS = ("memcheck", "racecheck", "initcheck", "synccheck")
#: tools run without the kernel-name filter: initcheck's state is every kernel's writes (see the module docstring)
UNFILTERED = frozenset({"initcheck"})
#: the child's exit status when a tool found something (``--error-exitcode``): apart from the launches' own 0-2
ERROR_EXIT = 86
_SUMMARY = re.compile(r"=+ (?:ERROR SUMMARY: (?P<errors>\d+) errors?|RACECHECK SUMMARY: (?P<hazards>\d+) hazards?"
                      r" displayed \((?P<race_errors>\d+) errors?, (?P<warnings>\d+) warnings?\))")
_FINDING = re.compile(r"^=+ +(Invalid|Error|Race|Uninitialized|Barrier|Warning|Program hit|Leaked)", re.IGNORECASE)


@dataclass
class ToolResult:
    """One tool's verdict on the launches: ``summary`` is its own summary line (or why there is none)."""

    tool: str
    passed: bool
    summary: str
    returncode: int | None
    seconds: float
    findings: list[str] = field(default_factory=list)
    log: Path | None = None


def find_sanitizer() -> str | None:
    """The compute-sanitizer executable (see the module docstring for where it is looked for), or None."""
    explicit = os.environ.get("COMPUTE_SANITIZER")
    if explicit:
        return explicit if Path(explicit).is_file() else None
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    dirs = []
    if os.environ.get("NVCC"):
        dirs.append(Path(os.environ["NVCC"]).parent)
    if os.environ.get("CUDA_HOME"):
        dirs.append(Path(os.environ["CUDA_HOME"]) / "bin")
    dirs.append(Path("/usr/local/cuda/bin"))
    for d in dirs:
        exe = d / "compute-sanitizer"
        if exe.is_file() and os.access(exe, os.X_OK):
            return str(exe)
    return None


def _command(exe: str, tool: str, target: Sequence[str], filtered: bool) -> list[str]:
    cmd = [exe, "--tool", tool]
    if filtered and tool not in UNFILTERED:
        cmd += ["--kernel-name", "kns=mtv_"]
    return [*cmd, "--print-limit", "20", "--error-exitcode", str(ERROR_EXIT), *target]


def _read(tool: str, text: str, rc: int | None, seconds: float, log: Path | None) -> ToolResult:
    """The verdict of one finished run from its output and exit status."""
    findings = [line.strip() for line in text.splitlines() if _FINDING.match(line.strip())][:5]
    matches = list(_SUMMARY.finditer(text))
    if not matches:
        tail = " | ".join(line.strip() for line in text.strip().splitlines()[-3:]) or "(no output)"
        return ToolResult(tool, False, f"no summary from compute-sanitizer (exit {rc}): {tail}", rc, seconds,
                          findings, log)
    m = matches[-1]
    if m.group("hazards") is not None:
        count = int(m.group("hazards")) + int(m.group("race_errors"))
        summary = (f"{m.group('hazards')} hazards displayed ({m.group('race_errors')} errors, "
                   f"{m.group('warnings')} warnings)")
    else:
        count = int(m.group("errors"))
        summary = f"{count} errors"
    if count == 0 and rc not in (0, ERROR_EXIT):  # clean tool, but the launches themselves failed
        summary += f"; the launches failed (exit {rc})"
    return ToolResult(tool, count == 0 and rc == 0, summary, rc, seconds, findings, log)


def run_tool(exe: str, tool: str, target: Sequence[str], timeout_s: float, log_dir: Path | None = None) -> ToolResult:
    """Run the launches ``target`` (a command) under ``tool``; a version that refuses the kernel-name filter
    (no summary line at all) is run once more without it."""
    log = log_dir / f"{tool}.log" if log_dir is not None else None
    result: ToolResult | None = None
    for filtered in (True, False) if tool not in UNFILTERED else (False,):
        t0 = time.monotonic()
        try:  # a session of its own: a tool past its time is ended with the launches it runs (they hold the GPU)
            proc = subprocess.Popen(_command(exe, tool, target, filtered), stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True,
                                    env={**os.environ, "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"})
        except OSError as exc:
            return ToolResult(tool, False, f"cannot run {exe}: {exc}", None, time.monotonic() - t0)
        try:
            text, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
            text, _ = proc.communicate()
            if log is not None:
                log.write_text(text or "")
            return ToolResult(tool, False, f"timed out after {timeout_s:.0f} s", None, time.monotonic() - t0,
                              log=log)
        if log is not None:
            log.write_text(text)
        result = _read(tool, text, proc.returncode, time.monotonic() - t0, log)
        if not result.summary.startswith("no summary") or not filtered:
            break
    assert result is not None
    return result


def _line(r: ToolResult) -> str:
    head = f"{r.tool:<10} {'PASS' if r.passed else 'FAIL'}  {r.summary}  ({r.seconds:.1f} s)"
    lines = [head] + [f"    {f}" for f in r.findings if not r.passed]
    if not r.passed and r.log is not None:
        lines.append(f"    full output: {r.log}")
    return "\n".join(lines)


def sanitize(echo: Callable[[str], None] = print, tools: Sequence[str] = TOOLS, timeout_s: float = 900.0,
             target: Sequence[str] | None = None, log_dir: Path | None = None) -> bool:
    """Run every tool in ``tools`` over the kernel's launches (``target``: the command, default ``python -m
    mla_tree_verify.sanitize`` with this interpreter); print a line per tool; True when every tool passed."""
    exe = find_sanitizer()
    if exe is None:
        echo("compute-sanitizer not found (looked at $COMPUTE_SANITIZER, PATH, beside $NVCC, $CUDA_HOME/bin and "
             "/usr/local/cuda/bin): install the CUDA toolkit's compute-sanitizer or set COMPUTE_SANITIZER")
        return False
    unknown = [t for t in tools if t not in TOOLS]
    if unknown:
        raise ValueError(f"unknown compute-sanitizer tool(s) {', '.join(unknown)}: choose from {', '.join(TOOLS)}")
    cmd = list(target) if target is not None else [sys.executable, "-m", "mla_tree_verify.sanitize"]
    logs = log_dir if log_dir is not None else Path(tempfile.mkdtemp(prefix="shadowd-sanitize-"))
    logs.mkdir(parents=True, exist_ok=True)
    echo(f"compute-sanitizer: {exe}; {len(tools)} tools over the kernel's launches (each takes up to a few "
         f"minutes); logs in {logs}")
    ok = True
    for tool in tools:
        r = run_tool(exe, tool, cmd, timeout_s, logs)
        ok &= r.passed
        echo(_line(r))
    return ok
