"""``shadowd selftest --sanitize``: how compute-sanitizer's verdicts are read, against a stand-in executable.

The stand-in (``COMPUTE_SANITIZER``) takes compute-sanitizer's command line, really runs the target command it is
given, and then prints what the plan for its tool says the real one prints: a clean summary, errors, race hazards,
a refusal of the kernel-name filter, or nothing for a minute (a hang); and, like the real initcheck, reads of memory
written by kernels the filter leaves out reported as uninitialized. The launches themselves (``mla_tree_verify
.sanitize``) need a GPU; their coverage is checked here on the CPU, their run under the real tools on the H200
(bench/results).
"""

from __future__ import annotations

import json
import os
import signal
import stat
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from shadowd.cli import EXIT_USAGE, main
from shadowd.sanitize import ERROR_EXIT, TOOLS, find_sanitizer, sanitize

FAKE = r'''#!PYTHON
import json, os, subprocess, sys, time
args = sys.argv[1:]
with open(os.environ["FAKE_ARGS_LOG"], "a") as f:
    f.write(json.dumps(args + ["ENV:" + os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING", "")]) + "\n")
tool = args[args.index("--tool") + 1]
plan = json.loads(os.environ.get("FAKE_PLAN", "{}")).get(tool, "clean")
i = args.index("--error-exitcode")
code, target = int(args[i + 1]), args[i + 2:]
if plan == "no_filter" and "--kernel-name" in args:
    print("Unrecognized option value for --kernel-name: kns=mtv_", flush=True)
    sys.exit(1)
if plan == "hang":
    time.sleep(60)
print("========= COMPUTE-SANITIZER", flush=True)
rc = subprocess.run(target).returncode
if tool == "initcheck" and "--kernel-name" in args:  # as the real one: blind to the writes of filtered-out kernels
    print("========= Uninitialized __global__ memory read of size 16 bytes")
    print("=========     at void mtv::mtv_fwd_kernel<(int)4, (int)0>(MtvArgs)+0x1170 in tree_verify_fwd.cuh:166")
    print("========= ERROR SUMMARY: 8353 errors")
    sys.exit(code)
if plan == "race":
    print("========= Error: Race reported between Write access at mtv_fwd_kernel<2, 1>+0x1a40")
    print("=========     and Read access at mtv_fwd_kernel<2, 1>+0x1b00 [1024 hazards]")
    print("========= RACECHECK SUMMARY: 2 hazards displayed (2 errors, 0 warnings)")
    sys.exit(code)
if plan == "oob":
    print("========= Invalid __global__ write of size 16 bytes")
    print("=========     at mtv_combine_kernel<8>(MtvArgs)+0x3f0")
    print("========= ERROR SUMMARY: 1 error")
    sys.exit(code)
if tool == "racecheck":
    print("========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)")
else:
    print("========= ERROR SUMMARY: 0 errors")
sys.exit(rc)
'''


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    exe = tmp_path / "compute-sanitizer"
    exe.write_text(FAKE.replace("PYTHON", sys.executable))
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("COMPUTE_SANITIZER", str(exe))
    monkeypatch.setenv("FAKE_ARGS_LOG", str(tmp_path / "args.log"))
    return tmp_path


def _target(tmp: Path, rc: int = 0) -> list[str]:
    script = tmp / "launches.py"
    script.write_text(f"print('ok B=1 L=[40] T=[9] H=3 splits 2')\nraise SystemExit({rc})\n")
    return [sys.executable, str(script)]


def _plan(monkeypatch: pytest.MonkeyPatch, **plan: str) -> None:
    monkeypatch.setenv("FAKE_PLAN", json.dumps(plan))


def _calls(tmp: Path) -> list[list[str]]:
    return [json.loads(line) for line in (tmp / "args.log").read_text().splitlines()]


def test_every_tool_clean_passes_and_checks_only_the_kernels_launches(fake: Path) -> None:
    out: list[str] = []
    assert sanitize(out.append, target=_target(fake), log_dir=fake / "logs")
    assert [line.split()[:2] for line in out[1:]] == [[t, "PASS"] for t in TOOLS]
    assert "0 hazards displayed (0 errors, 0 warnings)" in out[2] and "0 errors" in out[1]
    calls = _calls(fake)
    assert [c[c.index("--tool") + 1] for c in calls] == list(TOOLS)
    for c in calls:  # the kernel's own launches only, and a distinct exit status when a tool finds something
        if c[c.index("--tool") + 1] == "initcheck":  # every kernel: it must see the writes that made the inputs
            assert "--kernel-name" not in c
        else:
            assert c[c.index("--kernel-name") + 1] == "kns=mtv_"
        assert c[c.index("--error-exitcode") + 1] == str(ERROR_EXIT)
        assert c[-1] == "ENV:1", "every tensor an allocation of its own to the tools (no caching allocator)"
    assert "ERROR SUMMARY: 0 errors" in (fake / "logs" / "memcheck.log").read_text()


def test_a_race_or_an_out_of_bounds_write_fails_naming_the_tool_and_the_kernel(
        fake: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _plan(monkeypatch, racecheck="race", memcheck="oob")
    out: list[str] = []
    assert not sanitize(out.append, target=_target(fake), log_dir=fake / "logs")
    text = "\n".join(out)
    assert "memcheck   FAIL  1 errors" in text and "Invalid __global__ write of size 16 bytes" in text
    assert "racecheck  FAIL  2 hazards displayed (2 errors, 0 warnings)" in text
    assert "Race reported between Write access at mtv_fwd_kernel<2, 1>" in text
    assert f"full output: {fake / 'logs' / 'racecheck.log'}" in text
    assert "initcheck  PASS" in text and "synccheck  PASS" in text


def test_launches_that_fail_under_a_clean_tool_fail(fake: Path) -> None:
    # (a launch whose output was not finite where it must be, say: the sanitizer's summary alone is not the verdict)
    out: list[str] = []
    assert not sanitize(out.append, tools=["memcheck"], target=_target(fake, rc=1), log_dir=fake / "logs")
    assert "memcheck   FAIL  0 errors; the launches failed (exit 1)" in out[1]


def test_a_version_refusing_the_kernel_filter_is_run_again_checking_every_kernel(
        fake: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _plan(monkeypatch, synccheck="no_filter")
    out: list[str] = []
    assert sanitize(out.append, tools=["synccheck"], target=_target(fake), log_dir=fake / "logs")
    first, second = _calls(fake)
    assert "--kernel-name" in first and "--kernel-name" not in second
    assert "synccheck  PASS  0 errors" in out[1]


def test_a_hanging_tool_fails_after_its_time_limit_and_its_launches_end_with_it(
        fake: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _plan(monkeypatch, initcheck="hang")
    out: list[str] = []
    assert not sanitize(out.append, tools=["initcheck"], timeout_s=2.0, target=_target(fake), log_dir=fake / "l")
    assert "initcheck  FAIL  timed out after 2 s" in out[1]
    # a launch stuck under the tool (it holds the GPU) is ended with the tool, not left running
    stuck = fake / "stuck.py"
    # (it lets go of its output first, so only the signal, not the pipe, decides whether it outlives the tool)
    stuck.write_text(f"import os, time\nopen({str(fake / 'pid')!r}, 'w').write(str(os.getpid()))\n"
                     "os.close(1)\nos.close(2)\ntime.sleep(600)\n")
    _plan(monkeypatch)
    assert not sanitize(out.append, tools=["memcheck"], timeout_s=3.0, target=[sys.executable, str(stuck)],
                        log_dir=fake / "l")
    assert out[-1].startswith("memcheck   FAIL  timed out after 3 s")
    status = Path(f"/proc/{int((fake / 'pid').read_text())}/status")
    deadline = time.monotonic() + 10  # (SIGKILL is delivered, not awaited: give the kernel a moment to end it)
    while True:
        try:  # gone, or a zombie waiting for its new parent to reap it: it no longer runs
            state = status.read_text()
        except FileNotFoundError:
            state = "gone"
        if "zombie" in state or state == "gone" or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if not ("zombie" in state or state == "gone"):
        os.kill(int((fake / "pid").read_text()), signal.SIGKILL)
        line = next(x for x in state.splitlines() if x.startswith("State"))
        pytest.fail(f"the stuck launch outlived its tool: {line}")


def test_no_compute_sanitizer_fails_saying_where_it_looked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COMPUTE_SANITIZER", str(tmp_path / "nowhere"))
    assert find_sanitizer() is None
    out: list[str] = []
    assert not sanitize(out.append, target=["true"])
    assert out[0].startswith("compute-sanitizer not found") and "COMPUTE_SANITIZER" in out[0]
    monkeypatch.delenv("COMPUTE_SANITIZER")
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    monkeypatch.delenv("NVCC", raising=False)
    if not Path("/usr/local/cuda/bin/compute-sanitizer").exists():
        assert find_sanitizer() is None
    (tmp_path / "cuda" / "bin").mkdir(parents=True)
    beside = tmp_path / "cuda" / "bin" / "compute-sanitizer"
    beside.write_text("#!/bin/sh\n")
    beside.chmod(0o755)
    assert find_sanitizer() == str(beside)


def test_an_unknown_tool_is_refused(fake: Path) -> None:
    with pytest.raises(ValueError, match="unknown compute-sanitizer tool"):
        sanitize(lambda s: None, tools=["leakcheck"], target=["true"])


def test_selftest_sanitize_without_a_gpu_refuses(capsys: pytest.CaptureFixture[str]) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the refusal is for machines without one")
    assert main(["selftest", "--quick", "--sanitize"]) == 2
    assert "selftest needs a CUDA GPU" in capsys.readouterr().out
    assert main(["selftest", "--sanitize=yes"]) == EXIT_USAGE
    for bad in ("0", "-5", "nan", "inf", "soon"):
        assert main(["selftest", "--sanitize", "--sanitize-timeout", bad]) == EXIT_USAGE, bad
        assert "--sanitize-timeout" in capsys.readouterr().err, bad


def _host_choice(case: Any, splits: int) -> tuple[str, int | None]:
    """(forward instantiation, combine slices) as tree_verify_api.cuh chooses them from static sizes."""
    quarter = case.max_q_len * case.heads <= 32
    rows = case.q.shape[0] * case.heads
    slices = None if splits == 1 else 1 if rows >= 1024 else 2 if rows >= 512 else 4 if rows >= 256 else 8
    return f"<{4 if quarter else 2},{int(splits > 1)}>", slices


def test_the_launches_cover_every_kernel_instantiation() -> None:
    pytest.importorskip("torch")
    from mla_tree_verify import sanitize as launches

    cases = launches.cases("cpu")
    chosen = [_host_choice(c, s) for c, s, _ in cases]
    assert {k for k, _ in chosen} == {"<4,0>", "<4,1>", "<2,0>", "<2,1>"}
    assert {s for _, s in chosen if s is not None} == {8, 4, 2, 1}
    assert {0, 1} <= {n for c, _, _ in cases for n in c.prefix_lens}
    assert 257 in {t for c, _, _ in cases for t in c.tree_sizes}
    assert any(c.custom_mask is None for c, _, _ in cases), "a causal call without a mask"
    nan_leaf = [(c, s) for c, s, finite in cases if not finite]
    assert all(bool(c.k_draft.isnan().any()) for c, _ in nan_leaf)
    assert {_host_choice(c, s)[0] for c, s in nan_leaf} == {"<4,1>", "<2,1>"}


def test_the_launches_refuse_a_machine_without_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the launches run under the real tools there (bench/h200_kernel.sh)")
    from mla_tree_verify import sanitize as launches

    assert launches.main() == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


PLANTED = """
import torch, triton, triton.language as tl

@triton.jit
def mtv_planted_oob(p, n):
    i = tl.arange(0, 64)
    tl.store(p + n + i, tl.full([64], 1.0, tl.float32))  # 64 floats past the end

x = torch.zeros(1000, device="cuda")
mtv_planted_oob[(1,)](x, 1000)
torch.cuda.synchronize()
print("launched")
"""


def test_the_real_memcheck_fails_a_planted_out_of_bounds_write(tmp_path: Path) -> None:
    """The negative control on a GPU: the reading of compute-sanitizer's own output, not the stand-in's."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (runs on the H200: bench/results)")
    pytest.importorskip("triton")
    if find_sanitizer() is None:
        pytest.skip("needs NVIDIA's compute-sanitizer")
    script = tmp_path / "planted.py"
    script.write_text(PLANTED)
    out: list[str] = []
    assert not sanitize(out.append, tools=["memcheck"], timeout_s=300, target=[sys.executable, str(script)],
                        log_dir=tmp_path / "logs")
    text = "\n".join(out)
    assert "memcheck   FAIL" in text and "Invalid __global__ write" in text, text
    assert "mtv_planted_oob" in (tmp_path / "logs" / "memcheck.log").read_text()
