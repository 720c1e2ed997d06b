"""H200 benchmark of the SGLang plugin's hooked verify path (real SGLang Triton baseline, real
mla_tree_verify candidate), eager and inside a captured CUDA graph, in off / validate / on.

    python bench/sglang_hook.py [--quick] [--sample N] [--out FILE.json]
    python bench/sglang_hook.py --padded        # a padded graph replay: real requests only in the samples

Per shape: a ``layers``-layer verify step (bs requests, prefix L scattered over the cache, random
trees of T nodes, H heads, bf16) through ``TritonAttnBackend.forward_extend``:

* off      — SGLang's un-hooked forward_extend (the reference time);
* validate — the hooked call, every step sampled (both kernels + fused diff statistics);
* on       — the hooked call, spot check 1 in 100 (candidate only on the other steps).

Eager: CUDA-event time per step. Graph: the step captured once with ``torch.cuda.graph`` and
replayed; validate replays are checked bit-exact against SGLang's eager output and the number of
samples drained from the device ring is counted. Added time per layer = (mode − off) / layers.

Declared stand-ins (bench only): ``sgl_kernel`` (a CUDA wheel of hundreds of MB) and ``httpx2``,
which importing ``triton_backend`` on CUDA wants and the verify path never calls; ``torchvision``
only if the real one does not import.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import json
import os
import sys
import time
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


class _Inert:
    """Any attribute, call, index or iteration of a stand-in gives another inert value (calls: False)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Inert()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return False

    def __getitem__(self, key: Any) -> Any:
        return _Inert()

    def __iter__(self) -> Any:
        return iter(())


class _StandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``sgl_kernel`` / ``httpx2`` stand-ins: inert modules (``is_arch_support_pdl()`` → False)."""

    NAMES = ("sgl_kernel",)

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.split(".")[0] in self.NAMES:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        mod = types.ModuleType(spec.name)
        mod.__path__ = []  # type: ignore[attr-defined]

        def attr(name: str) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            return _Inert()

        mod.__getattr__ = attr  # type: ignore[method-assign]
        return mod

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def standins() -> None:
    import httpx

    sys.modules.setdefault("httpx2", httpx)  # httpx2 is httpx's successor; its import-time use needs URL
    sys.meta_path.insert(0, _StandIn())
    from tests.sglang import torchvision_stub

    torchvision_stub.install()


def make_case(tb: Any, *, bs: int, prefix: int, draft: int, heads: int, layers: int, seed: int = 0) -> Any:
    import torch
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(seed)
    slots = bs * (prefix + draft) * 2
    pool = MLATokenToKVPool(size=slots, page_size=1, dtype=torch.bfloat16, kv_lora_rank=512, qk_rope_head_dim=64,
                            layer_num=layers, device=dev, enable_memory_saver=False)
    for i in range(layers):
        pool.get_key_buffer(i).copy_(torch.randn(pool.get_key_buffer(i).shape, generator=g, device=dev) * 0.5)
    perm = torch.randperm(slots, generator=g, device=dev) + 1
    kv_indices = perm[: bs * prefix].to(torch.int64)
    out_cache_loc = perm[bs * prefix: bs * prefix + bs * draft].to(torch.int64)
    kv_indptr = torch.arange(0, (bs + 1) * prefix, prefix, dtype=torch.int64, device=dev)
    from tests.sglang.builders import tree_mask

    mask, mask_indptr = tree_mask([prefix] * bs, draft, torch.Generator().manual_seed(seed))
    md = tb.ForwardMetadata(
        attn_logits=None, attn_lse=None, max_extend_len=draft, num_kv_splits=None, kv_indptr=kv_indptr,
        kv_indices=kv_indices, qo_indptr=torch.arange(0, (bs + 1) * draft, draft, dtype=torch.int64, device=dev),
        custom_mask=mask.to(dev), mask_indptr=mask_indptr.to(dev),
        window_kv_indptr=None, window_kv_indices=None, window_num_kv_splits=None, window_kv_offsets=None)
    be = tb.TritonAttnBackend.__new__(tb.TritonAttnBackend)
    for name, value in dict(use_dense_fp8_chunked_prefill=False, use_mla=True, token_to_kv_pool=pool,
                            forward_metadata=md, dcp_size=1, enable_deterministic=False, use_verify_shared_kv=False,
                            use_verify_splitkv=False, extend_attention_fwd=extend_attention_fwd, dllm_attention=None,
                            page_size=1, allow_bidirectional_attention_in_extend=False, is_draft_runner=False,
                            req_to_token_pool=None).items():
        setattr(be, name, value)
    fb = ForwardBatch(forward_mode=ForwardMode.TARGET_VERIFY, batch_size=bs,
                      input_ids=torch.zeros(bs * draft, dtype=torch.int64, device=dev),
                      req_pool_indices=torch.arange(bs, device=dev), seq_lens=torch.full((bs,), prefix, device=dev),
                      out_cache_loc=out_cache_loc, seq_lens_sum=bs * prefix, seq_lens_cpu=torch.full((bs,), prefix))
    lyr = [RadixAttention(heads, 576, 192**-0.5, 1, i, v_head_dim=512) for i in range(layers)]
    q = [torch.randn(bs * draft, heads * 576, generator=g, device=dev, dtype=torch.bfloat16) * 0.5
         for _ in range(layers)]
    k = [torch.randn(bs * draft, 1, 576, generator=g, device=dev, dtype=torch.bfloat16) * 0.5 for _ in range(layers)]
    return types.SimpleNamespace(backend=be, layers=lyr, fb=fb, q=q, k=k)


def step(case: Any, fe: Any) -> list[Any]:
    return [fe(case.backend, q, k, k[..., :512], layer, case.fb) for layer, q, k in
            zip(case.layers, case.q, case.k, strict=True)]


def capture(case: Any, fe: Any) -> tuple[Any, list[Any]]:
    """The step captured in a CUDA graph (after a warm-up run on a side stream), and the graph's outputs."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step(case, fe)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gout = step(case, fe)
    return graph, gout


def time_eager(fn: Any, iters: int, warm: int = 1) -> float:
    """Mean ms per call over ``iters`` calls after ``warm`` untimed ones (enough to reach a sampled step, so that
    no Triton kernel compiles inside the timed loop)."""
    import torch

    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / iters


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sample", type=int, default=1, metavar="N",
                    help="validate samples 1 in N steps (under a graph the candidate gate idles it on the rest)")
    ap.add_argument("--out", default=os.environ.get("OUT", ".") + "/sglang_hook.json")
    ap.add_argument("--oracle-bundles", action="store_true",
                    help="only the eager oracle sampling and repro-bundle run (see oracle_and_bundles)")
    ap.add_argument("--padded", action="store_true",
                    help="only the padded-replay check (see padded_replay)")
    args = ap.parse_args()
    standins()
    import sglang
    import sglang.srt.layers.attention.triton_backend as tb
    import torch
    from sglang.srt.runtime_context import get_parallel

    from shadowd.hook.config import HookConfig, Sampling
    from shadowd.hook.runtime import HookRuntime, set_runtime
    from shadowd.sglang.verify import VerifyShadow

    original = tb.TritonAttnBackend.forward_extend
    if args.padded:
        with get_parallel().override(dcp_enabled=False):
            padded_replay(tb, original, args.out)
        return
    if args.oracle_bundles:
        with get_parallel().override(dcp_enabled=False):
            oracle_and_bundles(tb, original, args.out, args.quick)
        return
    shapes = [dict(bs=1, prefix=4096, draft=8, heads=8), dict(bs=1, prefix=32768, draft=16, heads=8),
              dict(bs=4, prefix=8192, draft=64, heads=16)]
    if args.quick:
        shapes = shapes[:1]
    layers, iters = 4, 10
    results: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                               "sglang": sglang.__version__, "layers_per_step": layers,
                               "validate_sample_every": max(1, args.sample), "shapes": []}
    with get_parallel().override(dcp_enabled=False):
        for shp in shapes:
            row: dict[str, Any] = dict(shp)
            case = make_case(tb, layers=layers, **shp)
            ref = [o.clone() for o in step(case, original)]
            row["off_eager_ms"] = time_eager(lambda case=case: step(case, original), iters)
            for mode in ("validate", "on"):
                samples: list[dict[str, Any]] = []
                rt = HookRuntime(HookConfig(mode=mode, spot_every=100, sampling=Sampling(max(1, args.sample))),
                                 sink=samples.append)
                set_runtime(rt)
                hook = VerifyShadow(runtime=rt, first_layer=0)

                def fe(*a: Any, hook: Any = hook, **kw: Any) -> Any:
                    return hook(original, *a, **kw)

                t0 = time.perf_counter()
                outs = step(case, fe)
                torch.cuda.synchronize()
                row[f"{mode}_first_call_s"] = round(time.perf_counter() - t0, 2)
                if mode == "validate":
                    row["validate_eager_bitexact"] = all(torch.equal(a, b) for a, b in zip(outs, ref, strict=True))
                else:
                    row["on_max_abs_vs_triton"] = max(float((a.float() - b.float()).abs().max())
                                                      for a, b in zip(outs, ref, strict=True))
                row[f"{mode}_eager_ms"] = time_eager(lambda case=case, fe=fe: step(case, fe), iters,
                                                     warm=max(1, args.sample) + 1)
                graph, gout = capture(case, fe)  # CUDA graph: the whole step, replayed below
                ds = rt._device
                if ds is not None:
                    ds.poll()
                graph.replay()
                torch.cuda.synchronize()
                if mode == "validate":
                    row["validate_graph_bitexact"] = all(torch.equal(a, b) for a, b in zip(gout, ref, strict=True))
                else:
                    row["on_graph_max_abs_vs_triton"] = max(float((a.float() - b.float()).abs().max())
                                                            for a, b in zip(gout, ref, strict=True))
                row[f"{mode}_graph_ms"] = time_eager(graph.replay, iters)
                time.sleep(0.05)
                drained = ds.poll() if ds is not None else []
                row[f"{mode}_graph_samples_per_replay"] = len(drained) / (iters + 2)
                if drained:
                    row[f"{mode}_graph_sample_rel_l2_max"] = max(float(d.get("rel_l2") or 0) for d in drained)
                row[f"{mode}_disabled"] = rt.disabled or rt.fallback
                del graph
            g_off = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g_off):
                step(case, original)
            row["off_graph_ms"] = time_eager(g_off.replay, iters)
            for mode in ("validate", "on"):
                for how in ("eager", "graph"):
                    row[f"{mode}_{how}_added_us_per_layer"] = round(
                        (row[f"{mode}_{how}_ms"] - row[f"off_{how}_ms"]) * 1e3 / layers, 1)
            print(json.dumps(row), flush=True)
            results["shapes"].append(row)
            del case
            torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(results, indent=1))


def padded_replay(tb: Any, original: Any, out: str) -> None:
    """Validate captured for a batch of 4, replayed as SGLang replays a smaller batch in that graph: the last
    request turned into padding in place (its write slots 0, its prefix the fill value 1 at slot 0, as the decode
    graph's buffer registry and the Triton backend's metadata leave it). Per replay: the samples' batch size and
    element count (the real requests' rows only) and the baseline's real rows bit-exact against SGLang's eager
    output."""
    import torch

    from shadowd.hook.config import HookConfig, Sampling
    from shadowd.hook.runtime import HookRuntime, set_runtime
    from shadowd.sglang.verify import VerifyShadow

    bs, draft, heads, layers = 4, 8, 8, 2
    case = make_case(tb, bs=bs, prefix=1024, draft=draft, heads=heads, layers=layers)
    samples: list[dict[str, Any]] = []
    rt = HookRuntime(HookConfig(mode="validate", sampling=Sampling(1)), sink=samples.append)
    set_runtime(rt)
    hook = VerifyShadow(runtime=rt, first_layer=0)

    def fe(*a: Any, **kw: Any) -> Any:
        return hook(original, *a, **kw)

    graph, gout = capture(case, fe)
    ds = rt.device()
    ds.poll()
    md, fb = case.backend.forward_metadata, case.fb
    rows: list[dict[str, Any]] = []
    for real in (4, 3, 1):
        if real < bs:  # request `real` .. bs-1 become padding, as SGLang leaves them in the static buffers
            fb.out_cache_loc[real * draft:].zero_()
            for b in range(real, bs):
                md.kv_indptr[b + 1] = md.kv_indptr[b] + 1
                md.kv_indices[md.kv_indptr[b]] = 0
                md.mask_indptr[b + 1] = md.mask_indptr[b] + draft * (1 + draft)
        ref = [o.clone() for o in step(case, original)]  # SGLang on the same (padded) inputs, eagerly
        torch.cuda.synchronize()
        graph.replay()
        torch.cuda.synchronize()
        time.sleep(0.05)
        got = ds.poll()
        rows.append(dict(real_requests=real, samples=len(got),
                         batch_sizes=sorted({int(g["batch_size"]) for g in got}),
                         numel=sorted({int(g["numel"]) for g in got}), expected_numel=real * draft * heads * 512,
                         prefix_lens=sorted({int(g["prefix_len"]) for g in got}),
                         # the real requests' rows (a padded token writes its K to the dummy slot 0, which the padded
                         # requests then read: which of them lands there last differs between runs, as in SGLang)
                         real_rows_bitexact=all(torch.equal(a[: real * draft], b[: real * draft])
                                                for a, b in zip(gout, ref, strict=True))))
        print(json.dumps(rows[-1]), flush=True)
    set_runtime(None)
    Path(out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "padded_replay": rows}, indent=1))


def oracle_and_bundles(tb: Any, original: Any, out: str, quick: bool) -> None:
    """Eager validate through the real SGLang path with oracle sampling on every call and a bundle tolerance
    of 0 (every sampled call breaches it): per shape, the oracle errors of candidate and Triton per layer,
    the first repro bundle (written by the streamer's side from a snapshot of the next call) and its replay
    (baseline, candidate and oracle rerun on the bundle's compact inputs)."""
    import tempfile

    import sglang
    import torch

    from shadowd.hook.config import HookConfig, Sampling
    from shadowd.hook.replay import replay_bundle
    from shadowd.hook.runtime import HookRuntime, set_runtime
    from shadowd.sglang.verify import VerifyShadow

    shapes = [dict(bs=1, prefix=4096, draft=8, heads=8), dict(bs=1, prefix=32768, draft=16, heads=8),
              dict(bs=4, prefix=8192, draft=64, heads=16)]
    if quick:
        shapes = shapes[:1]
    results: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                               "sglang": sglang.__version__, "shapes": []}
    for shp in shapes:
        root = Path(tempfile.mkdtemp(prefix="shadowd-bundles-"))
        case = make_case(tb, layers=4, **shp)
        samples: list[dict[str, Any]] = []
        rt = HookRuntime(HookConfig(mode="validate", sampling=Sampling(1), oracle_every=1, bundle_dir=root,
                                    bundle_max=1, bundle_rel_l2=0.0), sink=samples.append)
        set_runtime(rt)
        hook = VerifyShadow(runtime=rt, first_layer=0)

        def fe(*a: Any, hook: Any = hook, **kw: Any) -> Any:
            return hook(original, *a, **kw)

        for _ in range(3):  # step 1 arms every layer's site, step 2 is snapshotted, the polls save a bundle
            step(case, fe)
            for _ in range(3):
                torch.cuda.synchronize()
                samples.extend(rt.device().poll())
        row: dict[str, Any] = dict(shp)
        row["samples"] = len(samples)
        row["oracle_cand_err"] = [s["oracle_cand_err"] for s in samples[:4]]
        row["oracle_base_err"] = [s["oracle_base_err"] for s in samples[:4]]
        bundles = sorted(root.iterdir())
        row["bundles"] = len(bundles)
        row["bundle_mb"] = round(sum(f.stat().st_size for f in bundles[0].iterdir()) / 2**20, 1) if bundles else None
        if bundles:
            res = replay_bundle(bundles[0])
            row["replay_errors"] = res["errors"]
            row["replay_reproducible"] = res["reproducible"]
            row["replay_oracle"] = res["oracle"]
            row["replay_rerun_max_abs"] = (res["rerun"] or {}).get("max_abs")
        print(json.dumps(row), flush=True)
        results["shapes"].append(row)
        set_runtime(None)
        del case
        torch.cuda.empty_cache()
    Path(out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
