"""Per-process setup in every SGLang worker: the hook runtime, the run, the streamer.

Runs when the target model's ``TritonAttnBackend`` is constructed (an AROUND hook on its
``__init__``: the model runner is at hand there, and it happens in every spawned scheduler / TP
worker process). Once per process:

* builds the :class:`shadowd.hook.runtime.HookRuntime` from ``SHADOWD_*`` with ``rank`` = this
  process's TP rank and ``stage`` = its PP rank (each process is its own producer: the streamer's producer id
  is per process);
* refuses modes that are unsafe under CUDA graphs here (:mod:`shadowd.sglang.graphs`);
* with ``SHADOWD_URL`` set: registers the run (``POST /v1/runs``, idempotent on the run key, so
  every rank registering the same launch gets the same run) with the model's layer count, TP size,
  GPU, sglang version and both fingerprints — in a background thread, retried while the collector
  is unreachable — and starts the :class:`shadowd.hook.streamer.Streamer` (its producer stats carry
  the speculative-decoding counters of :mod:`shadowd.sglang.spec`). Samples submitted before the run
  is registered wait in the streamer's queue.

Run key: ``SHADOWD_RUN_KEY`` if the launching process set it; else systemd's ``INVOCATION_ID``
(one per service start, inherited by every child); else ``<host>-<parent pid>-<parent start time>``
— the same for all ranks spawned by one launcher, new for every launch.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import threading
import time
from collections.abc import Mapping
from typing import Any

from shadowd.hook.config import HookConfig
from shadowd.hook.runtime import HookRuntime, set_runtime
from shadowd.sglang.candidate import baseline_fingerprint, candidate_fingerprint
from shadowd.sglang.graphs import check_graph_safety, decode_graphs_enabled
from shadowd.sglang.spec import SpecCounters

__all__ = ["ProcessSetup", "derive_run_key", "run_fields"]

log = logging.getLogger("shadowd.sglang")


def derive_run_key(env: Mapping[str, str] | None = None) -> str:
    """The run key of this launch (see the module docstring)."""
    e = os.environ if env is None else env
    if e.get("SHADOWD_RUN_KEY"):
        return e["SHADOWD_RUN_KEY"]
    host = socket.gethostname()
    if e.get("INVOCATION_ID"):
        return f"{host}-systemd-{e['INVOCATION_ID'][:32]}"
    ppid = os.getppid()
    started = ""
    try:
        import psutil

        started = f"{psutil.Process(ppid).create_time():.0f}"
    except Exception:
        started = "0"
    return f"{host}-{ppid}-{started}"


def _gpu() -> tuple[str, str, str]:
    try:
        import torch

        if torch.cuda.is_available():
            i = torch.cuda.current_device()
            cap = torch.cuda.get_device_capability(i)
            return torch.cuda.get_device_name(i), f"sm_{cap[0]}{cap[1]}", f"cuda {torch.version.cuda}"
    except Exception:
        pass
    return "cpu", "", ""


def run_fields(run_key: str, num_layers: int, tp_size: int, sglang_version: str, model: str = "unknown",
               labels: dict[str, str] | None = None) -> dict[str, Any]:
    """The ``POST /v1/runs`` body."""
    gpu, arch, driver = _gpu()
    return {
        "run_key": run_key[:200], "model": (model or "unknown")[-200:], "num_layers": max(1, int(num_layers)),
        "tp_size": max(1, int(tp_size)), "gpu_name": gpu[:200], "gpu_arch": arch, "driver": driver[:100],
        "sglang_version": sglang_version[:50],
        "candidate": {"name": "mla_tree_verify", "fingerprint": candidate_fingerprint()[:200]},
        "baseline": {"name": "sglang-triton-extend_attention",
                     "fingerprint": baseline_fingerprint(sglang_version)[:200]},
        "labels": {"host": socket.gethostname(), "integration": "sglang-plugin", **(labels or {})},
    }


def _replica(p: Any, model_runner: Any) -> tuple[int, int]:
    # (replica, replicas) of a --dp-size launch without DP attention: SGLang's data-parallel controller numbers the
    # replicas (dp_rank; None or unwritten without a controller). With DP attention dp_size is 1 and the attention
    # groups are already told apart by tp_rank.
    def read(name: str) -> Any:
        try:
            return getattr(p, name) if p is not None else getattr(model_runner, name, None)
        except Exception:
            return getattr(model_runner, name, None)

    size, rank = read("dp_size"), read("dp_rank")
    if not isinstance(size, int) or isinstance(size, bool) or size <= 1:
        return 0, 1
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < size:
        return 0, 1
    return rank, size


def _parallel(model_runner: Any) -> tuple[int, int, int]:
    """(rank, ranks, stage): this worker's place among the workers of the launch that each run every layer's verify
    on a shard of their own — its TP rank, and across the replicas of ``--dp-size N`` (each a TP group of its own,
    with TP ranks counted from 0) replica × tp_size + TP rank, so that no two live workers of one stage report under
    one rank — and its pipeline stage (PP rank, 0 without ``--pp-size``). Pipeline stages keep their TP rank: each
    runs other layers, so per-(rank, layer) coverage stays apart; the collector keeps their producer figures apart
    by the stage (a rank's figures per stage are its latest producer's)."""
    try:
        from sglang.srt.runtime_context import get_parallel

        p: Any = get_parallel()
        tp_rank, tp_size = int(p.tp_rank), int(p.tp_size)
    except Exception:
        p = None
        tp_rank = int(getattr(model_runner, "tp_rank", 0) or 0)
        tp_size = int(getattr(model_runner, "tp_size", 1) or 1)
    replica, replicas = _replica(p, model_runner)
    return replica * tp_size + tp_rank, replicas * tp_size, _stage(p, model_runner)


def _stage(p: Any, model_runner: Any) -> int:
    # the PP rank: SGLang's parallel context, else the model runner's own (0 when neither says, or says nonsense)
    for source in (p, model_runner):
        try:
            rank, size = getattr(source, "pp_rank", None), getattr(source, "pp_size", None)
        except Exception:
            continue
        if isinstance(rank, int) and not isinstance(rank, bool) and (
                not isinstance(size, int) or 0 <= rank < size):
            return max(0, rank)
    return 0


class ProcessSetup:
    """The once-per-process setup; :meth:`backend_init_hook` is the AROUND hook on ``__init__``."""

    def __init__(self, sglang_version: str, spec: SpecCounters, env: Mapping[str, str] | None = None) -> None:
        self.sglang_version = sglang_version
        self.spec = spec
        self.env = os.environ if env is None else env
        self.runtime: HookRuntime | None = None
        self.error: BaseException | None = None
        self._lock = threading.Lock()

    def backend_init_hook(self, original: Any, backend: Any, model_runner: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(backend, model_runner, *args, **kwargs)
        if not getattr(model_runner, "is_draft_worker", False):
            self.setup(model_runner)
        return out

    def setup(self, model_runner: Any) -> HookRuntime:
        with self._lock:
            if self.runtime is not None:
                return self.runtime
            config = HookConfig.from_env(self.env)
            rank, tp_size, stage = _parallel(model_runner)
            if self.env.get("SHADOWD_RANK", str(rank)).strip() != str(rank):
                # (one value for every worker of a launch would merge all ranks into one producer and spool)
                log.warning("shadowd: SHADOWD_RANK=%s ignored under SGLang: this worker reports its own rank %d",
                            self.env["SHADOWD_RANK"], rank)
            if self.env.get("SHADOWD_STAGE", str(stage)).strip() != str(stage):
                log.warning("shadowd: SHADOWD_STAGE=%s ignored under SGLang: this worker reports its own pipeline "
                            "stage %d", self.env["SHADOWD_STAGE"], stage)
            config.rank = rank
            config.stage = stage
            device = str(getattr(model_runner, "device", "cuda"))
            check_graph_safety(config, device.startswith("cuda") and decode_graphs_enabled(model_runner), self.env)
            rt = HookRuntime(config)
            set_runtime(rt)
            self.runtime = rt
            mc = getattr(model_runner, "model_config", None)
            layers = int(getattr(mc, "num_hidden_layers", 0) or getattr(getattr(mc, "hf_text_config", None),
                                                                          "num_hidden_layers", 1) or 1)
            model = str(getattr(mc, "model_path", "") or "unknown")
            log.warning("shadowd: SGLang plugin active: mode %s, rank %d/%d%s, %d layers", config.mode, rank, tp_size,
                        f", pipeline stage {stage}" if stage else "", layers)
            nnodes = int(getattr(getattr(model_runner, "server_args", None), "nnodes", 1) or 1)
            if config.url and nnodes > 1 and not self.env.get("SHADOWD_RUN_KEY"):
                # the default key is per host (and systemd's INVOCATION_ID per node's unit): each node would
                # register a run of its own, and every run would wait forever for the other nodes' ranks
                log.error("shadowd: a %d-node launch without SHADOWD_RUN_KEY: each node registers a run of its own, "
                          "none of which hears from every rank (set the same SHADOWD_RUN_KEY on every node)", nnodes)
            if config.url:
                fields = run_fields(derive_run_key(self.env), layers, tp_size, self.sglang_version, model)
                self._start_streamer(rt, fields)
            elif config.mode != "off":
                log.error("shadowd: no SHADOWD_URL: mode %s runs without a collector — no samples are stored, and "
                          "no kill switch can reach this process%s", config.mode,
                          " (on mode still falls back in-process on a failing spot check)" if config.mode == "on"
                          else "")
            return rt

    def _start_streamer(self, rt: HookRuntime, fields: dict[str, Any]) -> None:
        from shadowd.client import BatchRejected, CollectorClient
        from shadowd.hook.spool import PENDING_RUN, Spool, spool_dir
        from shadowd.hook.streamer import Streamer
        from shadowd.wire import PRODUCER_STATS

        cfg = rt.config
        assert cfg.url is not None
        client = CollectorClient(cfg.url, cfg.token, timeout=cfg.http_timeout_s)
        # a directory per run key, pipeline stage and rank: what is spooled there belongs to that run (a worker
        # restarted under the same SHADOWD_RUN_KEY replays what the last one left); another launch's batches are never
        # in it, nor another live stage's
        spool = Spool(spool_dir(cfg.spool_dir, fields["run_key"], cfg.rank, stage=cfg.stage), cfg.spool_max_bytes)

        def stats() -> dict[str, int]:
            return {**rt.producer_stats(), **self.spec.producer_stats(PRODUCER_STATS)}

        streamer = Streamer(client, PENDING_RUN, spool, queue_max=cfg.queue_max, batch_max=cfg.batch_max,
                            flush_interval_s=cfg.flush_interval_s, poll_interval_s=cfg.poll_interval_s,
                            on_mode_override=rt.set_override, stats=stats, notes=rt.producer_notes, rank=cfg.rank,
                            stage=cfg.stage)
        streamer.pollers.append(lambda: rt._device.poll() if rt._device is not None else [])
        # started at once: until the run is registered (the collector may be down) batches go to the spool
        rt.streamer = streamer.start()
        atexit.register(streamer.close, 2.0)

        def register() -> None:
            delay = 0.5
            while True:
                try:
                    run = client.register_run(fields)
                    break
                except BatchRejected as e:
                    log.error("shadowd: the collector refused the run registration (%s): not streaming", e)
                    rt.streamer = None  # (what it spooled meanwhile stays for a launch of the key that registers)
                    streamer._stop.set()
                    if cfg.mode == "on":  # no kill switch and no spot-check reports: the candidate is not served
                        log.error("shadowd: on mode without a registered run cannot be switched off from the "
                                  "collector: serving the baseline (fix the registration and restart)")
                        rt.set_override("off")
                    return
                except Exception as e:
                    log.warning("shadowd: run registration failed (%r); retrying in %.1fs", e, delay)
                    time.sleep(delay)
                    delay = min(delay * 2, 30.0)
            rt.run_id = int(run["id"])
            rt.set_override(run.get("mode_override"))
            rt.start_gate(client, fields)
            streamer.run_id = rt.run_id  # (last: the streamer's thread then posts, the spooled batches first)
            log.warning("shadowd: run %d (%s), rank %d streaming to the collector; candidate %s, baseline %s",
                        rt.run_id, fields["run_key"], cfg.rank, (fields.get("candidate") or {}).get("fingerprint"),
                        (fields.get("baseline") or {}).get("fingerprint"))

        threading.Thread(target=register, name="shadowd-register", daemon=True).start()
