"""``shadowd demo``: the whole loop on a fresh machine without a GPU, in under two minutes.

It starts the collector (``shadowd serve``, SQLite, a subprocess) with the shipped demo policy,
registers a run, pushes a simulated MLA tree-verify workload (several layers, a mix of batch
sizes, tree sizes and prefix lengths) through the real hook (:class:`ShadowSite` in validate
mode) and the real streamer until the collector's verdict is definitive (at most ``duration``
seconds), then prints the readiness verdict and where to look.
``fault`` plants a faulty candidate: ``nan``, ``bias``, ``drift`` or ``crash``. Calls beyond the
bundle tolerance or failing hard leave repro bundles (at most :data:`DEMO_BUNDLES`, in the demo's own
temporary directory: never a production ``SHADOWD_BUNDLE_DIR``, whose bound they would count against)
that name importable callables — the fault's full-size form as the candidate — so ``shadowd replay``
reruns them; the end of the output says where they are.
Exit status 0 only when the verdict is READY.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from shadowd.cli import EXIT_USAGE, PortInUse, listen_socket
from shadowd.client import CollectorClient, CollectorError
from shadowd.hook.config import HookConfig, Sampling
from shadowd.hook.runtime import HookRuntime, set_runtime
from shadowd.hook.simulate import (
    FAULT_REFS,
    FAULTS,
    baseline_attention,
    candidate_attention,
    faulty,
    make_case,
    oracle_attention,
)
from shadowd.hook.site import Bucket, ShadowSite
from shadowd.hook.streamer import Streamer
from shadowd.readiness_cli import evidence_lines, shapes_line, timing_line

__all__ = ["DEMO_BUNDLES", "DEMO_POLICY", "DRIFT_RAMP_S", "run_demo"]

DEMO_POLICY = Path(__file__).parent / "policies" / "demo.toml"
#: seconds over which the ``drift`` fault grows to its full size (the workload itself may run longer: it runs
#: until the verdict is definitive, at most ``duration``)
DRIFT_RAMP_S = 60.0
#: repro bundles the demo writes at most (the first breaches: enough to replay one, little disk)
DEMO_BUNDLES = 5
#: a ``duration`` below this rarely reaches a verdict (the demo policy's 20 s span plus start-up): said so
SHORT_DURATION_S = 30.0
#: the shape mix: (batch size, tree sizes drawn from, prefix lengths drawn from); cycled so that every
#: shape bucket gathers samples at the same pace (EAGLE-like small trees, DDTree-like larger ones)
_PROFILES = (
    (1, (8,), (64, 127)),
    (1, (16,), (128, 255)),
    (2, (8, 6), (256, 511)),
    (2, (16, 12), (64, 127)),
    (4, (8, 5, 7), (64, 127)),
    (1, (32,), (256, 400)),
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    """In the collector's process, before it runs (Linux): a SIGTERM when the demo dies, however it dies (a SIGKILL
    runs none of the demo's own clean-up), so no collector outlives it."""
    import contextlib
    import ctypes
    import signal

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG


def _start_collector(db_url: str, port: int, log_path: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, SHADOWD_EVAL_INTERVAL_S="2", SHADOWD_TIME_BUCKET_S="5")
    if DEMO_POLICY.exists():
        env["SHADOWD_POLICY_FILE"] = str(DEMO_POLICY)
    cmd = [sys.executable, "-m", "shadowd", "serve", "--db", db_url, "--port", str(port), "--upgrade",
           "--log-level", "warning"]
    with open(log_path, "wb") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)


def _wait_up(client: CollectorClient, proc: subprocess.Popen[bytes], timeout: float = 90.0) -> bool:
    # (a collector that died is seen at once; a slow start on a loaded 2-core machine is waited for)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            client.health()
            return True
        except CollectorError:
            time.sleep(0.2)
    return False


def _config_refusal(proc: subprocess.Popen[bytes], log_path: Path) -> str | None:
    """The line a collector that exited with EXIT_USAGE wrote (what to fix), else None."""
    if proc.poll() != EXIT_USAGE:
        return None
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    said = [line for line in lines if line.startswith("shadowd: ")]
    return said[-1].removeprefix("shadowd: ") if said else None


def _workload_step(rng: random.Random, heads: int, step: int, seed: int) -> tuple[tuple[Any, ...], Bucket]:
    bs, sizes, (lo, hi) = _PROFILES[step % len(_PROFILES)]
    trees = [sizes[0]] + [rng.choice(sizes) for _ in range(bs - 1)]
    prefix = [hi] + [rng.randint(lo, hi) for _ in range(bs - 1)]
    args = make_case(prefix, trees, heads, seed=seed)
    return args, Bucket(batch_size=bs, draft_tokens=max(trees), prefix_len=max(prefix), heads=heads,
                        new_requests=bs if rng.random() < 0.5 else 0)


def run_demo(fault: str = "none", db_url: str | None = None, port: int | None = None, duration: float = 90.0,
             num_layers: int = 8, heads: int = 8, keep_serving: bool = False, seed: int = 0) -> int:
    """Run the demo (see the module docstring); returns the process exit status.

    ``db_url``: the collector's database (default a SQLite file in a temporary directory);
    ``port``: the collector's port (default a free one); ``duration``: the longest workload time in seconds
    (the workload stops as soon as the collector's verdict is definitive, so a slower or busier machine gets
    more traffic before it is judged; the drift fault ramps up over at most DRIFT_RAMP_S of it);
    ``keep_serving``: leave the collector running after the verdict until Ctrl-C.
    """
    if fault not in FAULTS:
        print(f"unknown fault {fault!r}; choose one of {', '.join(FAULTS)}", file=sys.stderr)
        return 2
    if port:  # (a collector already there would answer the demo's requests: its traffic would go there)
        try:
            listen_socket("127.0.0.1", port, hint="--port, or leave it out for a free one").close()
        except PortInUse as exc:
            print(f"shadowd demo: --port {port}: {exc}", file=sys.stderr)
            return EXIT_USAGE
    if duration < SHORT_DURATION_S:
        print(f"note: the demo policy needs samples spanning {SHORT_DURATION_S - 10:.0f} s from about 50 requests: "
              f"--duration {duration:g} is likely too short to reach a verdict")
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    work = Path(tempfile.mkdtemp(prefix="shadowd-demo-"))
    db_url = db_url or f"sqlite:///{work / 'shadowd.db'}"
    port = port or _free_port()
    url = f"http://127.0.0.1:{port}"
    print(f"shadowd demo: fault={fault}, {num_layers} layers, {heads} heads, simulated verify traffic on the CPU "
          f"until the verdict is definitive (at most {duration:.0f}s)")
    if DEMO_POLICY.exists():
        print(f"  judging with the DEMO policy {DEMO_POLICY} (looser confidence and targets so that two "
              "minutes suffice; production runs use the default policy)")
    else:
        print("  (demo policy file not found: judging with the default policy)")
    print(f"  collector: {url}  database: {db_url}  logs: {work / 'collector.log'}")
    proc = _start_collector(db_url, port, work / "collector.log")
    client = CollectorClient(url, timeout=10.0)
    streamer: Streamer | None = None
    restore = _stop_on_sigterm()  # a SIGTERM runs the cleanup below too: the collector never outlives the demo
    try:
        if not _wait_up(client, proc):
            refusal = _config_refusal(proc, work / "collector.log")
            if refusal is not None:  # (the demo's --db, or a SHADOWD_* setting: the collector's one line says what)
                print(f"shadowd demo: the collector refused its configuration: {refusal}", file=sys.stderr)
                return EXIT_USAGE
            print("the collector did not start; see " + str(work / "collector.log"), file=sys.stderr)
            return 1
        bundles = work / "bundles"  # (the demo's own: SHADOWD_BUNDLE_DIR is production's)
        cfg = HookConfig(mode="validate", sampling=Sampling(1), url=url, run_key=f"demo-{fault}-{int(time.time())}",
                         oracle_every=50, spool_dir=work / "spool", disable_after=50, flush_interval_s=0.2,
                         bundle_dir=bundles, bundle_max=DEMO_BUNDLES)
        rt = HookRuntime(cfg)
        streamer = rt.start_streaming({
            "model": "simulated-mla (Kimi-K2-like shapes)", "num_layers": num_layers, "tp_size": 1,
            "gpu_name": "cpu (simulated)", "gpu_arch": "cpu", "driver": "none", "sglang_version": "none",
            "candidate": {"name": "blockwise-bf16-p" + ("" if fault == "none" else f"+{fault}"),
                          "fingerprint": f"demo-cand-{fault}"},
            "baseline": {"name": "gathered-fp32", "fingerprint": "demo-base"},
            "labels": {"demo": "1", "fault": fault}, "started_at": time.time()}, client=client)
        run_id = int(rt.run_id or 0)
        set_runtime(rt)
        cand = faulty(candidate_attention, fault, duration_s=min(duration, DRIFT_RAMP_S))
        sim = baseline_attention.__module__
        refs = {"baseline": f"{sim}:baseline_attention", "candidate": FAULT_REFS[fault],
                "oracle": f"{sim}:oracle_attention"}
        site = ShadowSite("mla_tree_verify", baseline_attention, cand, oracle=oracle_attention, runtime=rt,
                          refs=refs)
        rng = random.Random(seed)
        t0 = last = checked = time.monotonic()
        steps = 0
        while time.monotonic() - t0 < duration:
            if time.monotonic() - checked > 5 and time.monotonic() - t0 > 20:
                checked = time.monotonic()
                if _definitive(client, run_id):
                    print(f"  [{checked - t0:5.1f}s] the collector has a definitive verdict: stopping the workload")
                    break
            args, bucket = _workload_step(rng, heads, steps, seed * 100_000 + steps)
            q = args[0]
            for layer in range(num_layers):
                layer_args = (torch.roll(q, shifts=layer, dims=1), *args[1:])
                site(*layer_args, layer=layer, bucket=bucket)
            steps += 1
            if time.monotonic() - last > 5:
                last = time.monotonic()
                state = ("DISABLED" if rt.disabled else f"failing ({rt.candidate_failures} calls)"
                         if rt.candidate_failures else "ok")
                print(f"  [{last - t0:5.1f}s] {steps} steps, {rt.emitted} samples, {streamer.sent} stored, "
                      f"spool {streamer.spool.depth()}, candidate {state}", flush=True)
        streamer.flush(30.0)
        print(f"  workload done: {steps} verify steps × {num_layers} layers, {streamer.sent} samples stored, "
              f"{streamer.dropped} dropped, {streamer.rejected} rejected")
        code = _verdict(client, run_id, fault, url)
        _bundles_line(bundles)
        if code and fault == "none" and steps:
            print(f"\n(not enough evidence after {time.monotonic() - t0:.0f}s of traffic, {steps} verify steps, on "
                  f"this machine: rerun with a longer --duration, e.g. --duration {2 * duration:.0f}, or on a less "
                  "busy machine)")
        if not keep_serving:
            policy = f" --policy {DEMO_POLICY}" if DEMO_POLICY.exists() else ""
            print(f"\n(the collector stops now; rerun with --keep-serving to browse these pages, or serve the "
                  f"database again with the demo policy: shadowd serve --db {db_url}{policy})")
        return code
    finally:
        try:
            if streamer is not None:
                streamer.close(2.0)
            set_runtime(None)
            if keep_serving and proc.poll() is None:
                print(f"collector still serving at {url} — Ctrl-C (or SIGTERM) to stop")
                with contextlib.suppress(KeyboardInterrupt, SystemExit):
                    proc.wait()
        finally:  # whatever happened above, the collector this demo started stops with it
            restore()
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
            client.close()


def _stop_on_sigterm() -> Callable[[], None]:
    """Make SIGTERM end the demo like Ctrl-C does (its ``finally`` stops the collector it started); returns
    the function that restores the previous handler. Only the main thread can install one (else a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)

    def restore() -> None:
        signal.signal(signal.SIGTERM, previous)

    return restore


def _bundles_line(root: Path) -> None:
    saved = sorted(p for p in root.iterdir() if (p / "meta.json").is_file()) if root.is_dir() else []
    if saved:
        print(f"\nrepro bundles: {len(saved)} in {root} (inputs and both outputs of breaching or failing calls); "
              f"rerun one:\n  shadowd replay {saved[-1]}")
    else:
        print(f"\nrepro bundles: none (no call breached the bundle tolerance or failed; they would be in {root})")


def _definitive(client: CollectorClient, run_id: int) -> bool:
    try:
        _, body = client.readiness(run_id)
    except CollectorError:
        return False
    return body.get("verdict") in ("READY", "NOT_READY")


def _verdict(client: CollectorClient, run_id: int, fault: str, url: str) -> int:
    body: dict[str, Any] = {}
    status = 0
    deadline = time.monotonic() + 20.0
    while time.monotonic() < deadline:
        status, body = client.readiness(run_id)
        if (status == 200) == (fault == "none"):
            break
        time.sleep(1.0)
    verdict = body.get("verdict")
    print(f"\nreadiness verdict for run {run_id}: {verdict}")
    for reason in body.get("reasons", [])[:12]:
        print(f"  - {reason}")
    for line in evidence_lines(body):  # READY: what it rests on
        print(line)
    shapes = shapes_line(body)
    if shapes is not None:  # and the shapes it speaks for
        print(shapes)
    speed = timing_line(body)
    if speed is not None:  # (host time of two CPU implementations here: what a GPU run reports per device)
        print(f"{speed} (the demo's two CPU implementations, host time)")
    print("\nwhere to look:")
    print(f"  status page     {url}/?run_id={run_id}")
    print(f"  readiness       {url}/readiness?run_id={run_id}")
    print(f"  per-layer view  {url}/readiness/{run_id}/layers")
    print(f"  metrics         {url}/metrics")
    if fault != "none":
        print(f"\n(planted fault {fault!r}: NOT_READY is the expected verdict; exit status 0 means READY only)")
    return 0 if status == 200 and verdict == "READY" else 1
