"""Every Triton launch the hook's device path makes compiles for sm_90 and sm_120: a compile-only check.

The device path's CPU tests run its kernels under Triton's interpreter, which accepts code the compiler refuses (the
padding kernel's plain module global, session 32, would have raised on its first GPU launch). So the launches that
``interp_scenario.py`` makes — recorded by ``launch_recorder.py`` as the JIT would specialize them: argument types,
the divisible-by-16 hints of aligned pointers and integers, constexprs, launch options — are compiled here for real
targets with Triton's bundled ptxas, no GPU needed, in the form a GPU runs them: what the interpreted run turns off
for want of a GPU (programmatic dependent launch, the global timer, stamps) turned on, and the statistics kernel in
the configuration ``stats_config`` gives each recorded variant on a GPU (its small tile, inline-PTX histogram and
register cap; its other tiles: ``test_stats_build.py``). No build may use local memory or stack. The build runs in
a subprocess without ``TRITON_INTERPRET`` (other tests of the suite turn the interpreter on for this process).
Skipped with the reason when Triton or its NVIDIA tools are not installed.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest


def launched_kernels() -> set[str]:
    """The Triton kernels ``shadowd/hook`` launches (``name[(grid)](...)`` in its source, resolved in the module
    that launches it): the scenario must reach each one, or this check covers less than the hook runs."""
    found = set()
    for path in sorted((Path(__file__).resolve().parents[2] / "shadowd" / "hook").glob("*.py")):
        module = importlib.import_module(f"shadowd.hook.{path.stem}")
        for name in set(re.findall(r"\b([A-Za-z_]\w*)\[\(", path.read_text())):
            fn = getattr(getattr(module, name, None), "fn", None)
            if fn is not None:
                found.add(fn.__name__)
    return found
#: constexprs that the interpreted run holds off because there is no GPU; a GPU launch turns them on
DEVICE_ONLY = ("PDL", "USE_TIMER", "GPU", "STAMP")
#: (compute capability, SMs): an H100 / H200 and an RTX PRO 6000 Blackwell
TARGETS = ((90, 132), (120, 188))

SCRIPT = r'''
import importlib, json, re, subprocess, sys
from pathlib import Path

import triton
import triton.backends.nvidia as nv
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from shadowd.hook.launch import stats_config

launches, out_dir = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
device_only, targets = json.loads(sys.argv[3]), json.loads(sys.argv[4])
tools = Path(nv.__file__).parent / "bin"
if not (tools / "ptxas").exists() or not (tools / "cuobjdump").exists():
    print("RESULT " + json.dumps({"skip": f"Triton's NVIDIA tools (ptxas, cuobjdump) are not in {tools}"}))
    sys.exit(0)
OPTIONS = ("num_warps", "maxnreg", "launch_pdl")
built = []
for i, launch in enumerate(launches):
    fn = getattr(importlib.import_module(launch["module"]), launch["name"])
    names = list(launch["signature"])
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in launch["aligned"]}
    for arch, sms in targets:
        constexprs, options = dict(launch["constexprs"]), dict(launch["options"])
        if launch["name"] == "_stats_kernel":
            # its GPU configuration for the recorded variant (the interpreted run takes the interpreter's: tl.histogram,
            # no register cap), at the small tile; the other tiles: test_stats_build.py
            size = {"*fp64": 8, "*fp32": 4, "*bf16": 2, "*fp16": 2}[launch["signature"]["c_ptr"]]
            _nprog, config = stats_config(2**16, size, sms, pdl=True, stamp=True, has_valid=constexprs["HAS_VALID"],
                                          has_flag=constexprs["HAS_FLAG"], publish=constexprs["PUBLISH"],
                                          interpret=False)
            constexprs.update({k: v for k, v in config.items() if k not in OPTIONS})
            options = {k: v for k, v in config.items() if k in OPTIONS}
        for name in device_only:
            if name in constexprs:
                constexprs[name] = True
        if constexprs.get("PDL"):
            options["launch_pdl"] = True
        row = {"name": launch["name"], "arch": arch, "constexprs": constexprs, "options": options}
        try:
            kernel = triton.compile(ASTSource(fn, launch["signature"], constexprs=constexprs, attrs=attrs),
                                    target=GPUTarget("cuda", arch, 32), options=options)
        except Exception as e:  # reported per launch, with its configuration
            row["error"] = f"{type(e).__name__}: {e}"[:2000]
        else:
            cubin = out_dir / f"{i}-{arch}.cubin"
            cubin.write_bytes(kernel.asm["cubin"])
            row["usage"] = subprocess.run([str(tools / "cuobjdump"), "-res-usage", str(cubin)], capture_output=True,
                                          text=True, check=True).stdout
        built.append(row)
print("RESULT " + json.dumps(built))
'''


@pytest.fixture(scope="module")
def builds(interp_run: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Each recorded launch built for each target: its configuration and ``cuobjdump -res-usage`` (or the error)."""
    tmp = tmp_path_factory.mktemp("kernels-build")
    (tmp / "launches.json").write_text(json.dumps(interp_run["launches"]))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp / "launches.json"), str(tmp),
                           json.dumps(DEVICE_ONLY), json.dumps(TARGETS)], capture_output=True, text=True, env=env,
                          timeout=900)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, proc.stdout[-2000:] + proc.stderr[-4000:]
    res = json.loads(line[0][7:])
    if isinstance(res, dict):
        pytest.skip(res["skip"])
    return list(res)


def test_the_scenario_reaches_every_hook_kernel(interp_run: dict[str, Any]) -> None:
    pytest.importorskip("triton")
    kernels = launched_kernels()
    assert {"_control_kernel", "_stats_kernel", "_select_kernel"} <= kernels, kernels  # (the finder finds)
    assert {launch["name"] for launch in interp_run["launches"]} == kernels


def test_every_recorded_launch_compiles_for_sm90_and_sm120(builds: list[dict[str, Any]],
                                                          interp_run: dict[str, Any]) -> None:
    assert len(builds) == len(interp_run["launches"]) * len(TARGETS)
    failed = [b for b in builds if "error" in b]
    assert not failed, "\n".join(f"{b['name']} sm_{b['arch']} {b['constexprs']} {b['options']}: {b['error']}"
                                 for b in failed)
    # the device forms were built: programmatic dependent launch and the timer on where a kernel has them
    assert all(b["options"].get("launch_pdl") for b in builds if "PDL" in b["constexprs"])
    assert any(b["constexprs"].get("USE_TIMER") for b in builds)


def test_every_build_stays_in_registers(builds: list[dict[str, Any]]) -> None:
    for b in builds:
        m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", b.get("usage", ""))
        assert m, b
        stack, local = int(m.group(2)), int(m.group(4))
        assert stack == 0 and local == 0, f"{b['name']} sm_{b['arch']} {b['constexprs']}: {m.group(0)}"
