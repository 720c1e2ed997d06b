"""Fixtures for the hook tests: a real collector subprocess, toy call sites, a recording sink, the interpreted
device-path scenario."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from shadowd.client import CollectorClient, CollectorError
from shadowd.hook.config import HookConfig, Sampling
from shadowd.hook.runtime import HookRuntime


def wait_for(cond: Callable[[], Any], timeout: float = 30.0) -> bool:
    """Poll ``cond`` until it holds or ``timeout`` seconds pass; whether it held."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Collector:
    """``shadowd serve`` on SQLite in a subprocess; can be stopped and restarted on the same port."""

    def __init__(self, tmp: Path) -> None:
        self.db_path = tmp / "collector.db"
        self.db_url = f"sqlite:///{self.db_path}"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / "collector.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        cmd = [sys.executable, "-m", "shadowd", "serve", "--db", self.db_url, "--port", str(self.port),
               "--upgrade", "--log-level", "warning"]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        client = CollectorClient(self.url, timeout=2.0)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()[-2000:]
            try:
                client.health()
                client.close()
                return
            except CollectorError:
                time.sleep(0.2)
        raise RuntimeError("collector did not start: " + self.log.read_text()[-2000:])

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(15)
        self.proc = None


@pytest.fixture
def collector(tmp_path: Path) -> Iterator[Collector]:
    c = Collector(tmp_path)
    c.start()
    yield c
    c.stop()


RUN = {"model": "toy", "num_layers": 4, "tp_size": 1, "gpu_name": "cpu", "gpu_arch": "cpu", "driver": "none",
       "sglang_version": "none", "candidate": {"name": "cand", "fingerprint": "c1"},
       "baseline": {"name": "base", "fingerprint": "b1"}, "labels": {"test": "hook"}}


def run_body(key: str) -> dict[str, Any]:
    return dict(RUN, run_key=key)


class Sink(list):  # type: ignore[type-arg]
    """Records emitted samples."""

    def __call__(self, sample: dict[str, Any]) -> None:
        self.append(sample)


def make_runtime(mode: str = "validate", sink: Sink | None = None, **kw: Any) -> tuple[HookRuntime, Sink]:
    s = sink if sink is not None else Sink()
    kw.setdefault("sampling", Sampling(1))
    cfg = HookConfig(mode=mode, **kw)
    return HookRuntime(cfg, sink=s), s


def base_fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A toy 'attention': bf16 matmul with fp32 accumulation."""
    return (x.float() @ w.float()).to(torch.bfloat16)


def cand_fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A second correct implementation: two half sums rounded to bf16 first (different rounding)."""
    k = x.shape[1] // 2
    lo = (x[:, :k].float() @ w[:k].float()).to(torch.bfloat16).float()
    hi = (x[:, k:].float() @ w[k:].float()).to(torch.bfloat16).float()
    return (lo + hi).to(torch.bfloat16)


def inputs(seed: int = 0, rows: int = 16, k: int = 64, n: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, k, generator=g).to(torch.bfloat16), torch.randn(k, n, generator=g).to(torch.bfloat16))


@pytest.fixture(scope="session")
def interp_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The device path's scenario (``interp_scenario.py``) run once under ``TRITON_INTERPRET=1`` in a subprocess:
    ``{"result": its RESULT dict, "launches": the distinct Triton launches it made}`` (``launch_recorder.py``).
    Skipped when Triton is not installed."""
    pytest.importorskip("triton")
    here = Path(__file__).resolve().parent
    launches = tmp_path_factory.mktemp("interp") / "launches.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "SHADOWD_RECORD_LAUNCHES": str(launches),
           "PYTHONPATH": os.pathsep.join([str(here.parents[1]), str(here)])}
    code = f"import launch_recorder, runpy; runpy.run_path({str(here / 'interp_scenario.py')!r}, run_name='__main__')"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and line, proc.stdout[-2000:] + proc.stderr[-4000:]
    return {"result": json.loads(line[0][7:]), "launches": json.loads(launches.read_text())}
