"""A graph replay's real requests, read from device memory (``shadowd.sglang.padding``).

The padded batch is made by SGLang's own decode-graph buffer registry (``build_decode_registry``, its
``fill_from`` / ``extract_buffer``), so a change of SGLang's padding policy fails these tests; the functions
under test are plain torch ops, run here on CPU tensors; the GPU path's one Triton kernel
(``shadowd.sglang.triton_padding``) is held to them under Triton's interpreter and, with CUDA, inside a graph.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from shadowd.hook.site import ShadowSite
from shadowd.sglang.padding import META_FIELDS, graph_shape
from shadowd.sglang.verify import _make_bucket
from tests.sglang.builders import make_case


def _indptr(lens: list[int] | torch.Tensor) -> torch.Tensor:
    t = torch.as_tensor(lens, dtype=torch.int64)
    return torch.cat([torch.zeros(1, dtype=torch.int64), t.cumsum(0)])


def _padded(sgl: Any, prefix: tuple[int, ...], draft: int, padded_bs: int) -> tuple[Any, Any, Any]:
    """A real verify case and its forward batch as SGLang's graph registry pads it to ``padded_bs`` requests,
    with the verify metadata the Triton backend derives from the padded buffers."""
    from sglang.srt.model_executor.cuda_graph_buffer_registry import build_decode_registry

    case = make_case(sgl, prefix=prefix, draft=draft)
    raw_bs = len(prefix)
    fill = sgl.TritonAttnBackend.get_cuda_graph_seq_len_fill_value(case.backend)
    reg = build_decode_registry(device=torch.device("cpu"), max_bs=padded_bs, max_num_token=padded_bs * draft,
                                seq_len_fill_value=fill, cache_loc_dtype=torch.int64, share_pool=False)
    stale = reg.get_slot("out_cache_loc").buffer
    stale.fill_(9)  # an earlier, larger replay's slots: the padding policy must reset them
    reg.fill_from(case.forward_batch, raw_bs=raw_bs, padded_bs=padded_bs, raw_num_tokens=raw_bs * draft,
                  padded_num_tokens=padded_bs * draft)
    fb = reg.extract_buffer(padded_bs=padded_bs, padded_num_tokens=padded_bs * draft,
                            forward_batch_template=case.forward_batch)
    fb.batch_size = padded_bs
    md = case.backend.forward_metadata
    md.qo_indptr = torch.arange(0, (padded_bs + 1) * draft, draft, dtype=torch.int64)
    md.kv_indptr = _indptr(fb.seq_lens)  # target verify: the prefix of each (padded) request
    return case, fb, md


def test_a_padded_replay_counts_only_the_real_requests_and_rows(sgl: Any) -> None:
    _, fb, md = _padded(sgl, prefix=(7, 13, 2), draft=4, padded_bs=8)
    assert fb.seq_lens.tolist()[3:] == [1] * 5, "SGLang pads seq_lens with the Triton backend's fill value"
    meta = graph_shape(md.qo_indptr, md.kv_indptr, fb.out_cache_loc, 8, 4, 32)
    assert dict(zip(META_FIELDS, meta.tolist(), strict=True)) == dict(
        batch_size=3, draft_tokens=4, prefix_len=13, valid_rows=12)


def test_the_longest_prefix_ignores_padded_requests(sgl: Any) -> None:
    # every real request has an empty prefix; the padded ones hold the fill value (1)
    _, fb, md = _padded(sgl, prefix=(0, 0), draft=3, padded_bs=4)
    assert graph_shape(md.qo_indptr, md.kv_indptr, fb.out_cache_loc, 4, 3, 12).tolist() == [2, 3, 0, 6]


def test_a_full_batch_is_all_real(sgl: Any) -> None:
    _, fb, md = _padded(sgl, prefix=(5, 9), draft=4, padded_bs=2)
    assert graph_shape(md.qo_indptr, md.kv_indptr, fb.out_cache_loc, 2, 4, 8).tolist() == [2, 4, 9, 8]


def test_the_graph_bucket_carries_the_device_shape_and_real_rows(sgl: Any) -> None:
    case, fb, md = _padded(sgl, prefix=(7, 13, 2), draft=4, padded_bs=4)
    site = ShadowSite("s", lambda *a: None, lambda *a: None, first_layer=0)
    b0 = _make_bucket(16, 2, fb, md, site, 0, capturing=True)
    assert isinstance(b0.valid_rows, torch.Tensor) and int(b0.valid_rows) == 12
    assert b0.meta is not None and b0.meta.tolist() == [3, 4, 13]
    b1 = _make_bucket(16, 2, fb, md, site, 1, capturing=True)
    assert b1.meta is not None and b1.meta.data_ptr() == b0.meta.data_ptr(), "one shape tensor per forward"
    # eagerly (no padding in an eager verify batch) the bucket is the host's
    be = _make_bucket(12, 2, case.forward_batch, case.backend.forward_metadata, site, 0, capturing=False)
    assert (be.batch_size, be.draft_tokens, be.prefix_len, be.valid_rows, be.meta) == (3, 4, 13, 12, None)


def test_all_padding_has_no_real_request() -> None:
    qo = torch.arange(0, 5 * 2, 2)
    kv = _indptr([1, 1, 1, 1])
    assert graph_shape(qo, kv, torch.zeros(8, dtype=torch.int64), 4, 2, 8).tolist() == [0, 2, 0, 0]


def test_without_write_slots_every_row_is_real() -> None:
    qo = torch.arange(0, 4 * 3, 3)
    assert graph_shape(qo, _indptr([4, 0, 6]), None, 3, 3, 9).tolist() == [3, 3, 6, 9]
    assert graph_shape(qo, _indptr([4, 0, 6]), None, 3, 3, 0).tolist() == [0, 3, 0, 0]


def test_requests_of_different_sizes_count_by_their_first_row() -> None:
    # a ragged batch: 3, 1 and 2 draft rows, the last request padding (no slot) and an empty one after it
    qo = torch.tensor([0, 3, 4, 6, 6])
    loc = torch.tensor([11, 12, 13, 14, 0, 0])
    assert graph_shape(qo, _indptr([5, 8, 1, 1]), loc, 4, 3, 6).tolist() == [2, 3, 8, 4]


@pytest.mark.parametrize(("bs", "rows"), [(0, 4), (2, -1)])
def test_bad_sizes_are_refused_by_name(bs: int, rows: int) -> None:
    with pytest.raises(ValueError, match="bs must be >= 1 and rows >= 0"):
        graph_shape(torch.arange(3), torch.arange(3), None, bs, 1, rows)


def test_an_eager_batch_padded_for_data_parallel_attention_keeps_its_real_size(sgl: Any) -> None:
    # ForwardBatch.prepare_mlp_sync_batch: it notes the real batch size, then pads inputs to the DP group's size
    # (SGLang's own _pad_inputs_to_size, which notes the real token count)
    from types import SimpleNamespace

    case = make_case(sgl, prefix=(7, 13), draft=4)
    fb = case.forward_batch
    fb.positions = torch.arange(8)  # (a verify batch's token positions; the builder leaves them out)
    fb._original_batch_size = fb.batch_size
    fb._pad_inputs_to_size(SimpleNamespace(attn_backend=case.backend), 16, 4)
    fb.batch_size = 4
    assert fb.out_cache_loc.shape[0] == 16 and fb._original_num_tokens == 8
    site = ShadowSite("s", lambda *a: None, lambda *a: None, first_layer=0)
    b = _make_bucket(16, 2, fb, case.backend.forward_metadata, site, 0, capturing=False)
    assert (b.batch_size, b.prefix_len, b.valid_rows) == (2, 13, 8)


def test_the_triton_backend_captures_no_per_request_verify_lengths(sgl: Any) -> None:
    """``graph_shape`` takes the draft tokens per request as the step's constant. SGLang captures per-request verify
    lengths (the ragged verify layout) only for backends that declare ``supports_ragged_verify_graph``; should
    SGLang's Triton backend declare it, the padding read must learn the ragged layout."""
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

    assert sgl.TritonAttnBackend.supports_ragged_verify_graph is False
    assert AttentionBackend.supports_ragged_verify_graph is False


def _random_cases(seed: int) -> list[tuple[Any, ...]]:
    """(qo_indptr, kv_indptr, out_cache_loc, bs, draft, rows) of padded graph batches: requests of one or several
    draft sizes, some empty, a padded tail of zero slots, zero slots inside real requests past their first row,
    int32 and int64 metadata, batches wider than one loop iteration of the kernel, and no write slots at all."""
    g = torch.Generator().manual_seed(seed)
    cases: list[tuple[Any, ...]] = []
    for bs, draft, ragged, idx_dtype, none_loc in [
            (1, 1, False, torch.int32, False), (3, 4, False, torch.int64, False), (8, 16, True, torch.int32, False),
            (33, 2, True, torch.int64, False), (160, 8, False, torch.int32, False),
            (1500, 1, True, torch.int64, False), (5, 3, False, torch.int32, True),
            (1300, 2, False, torch.int64, True)]:
        sizes = (torch.randint(0, draft + 1, (bs,), generator=g) if ragged else torch.full((bs,), draft))
        qo = torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)])
        rows = max(int(qo[-1]), 1)
        real = int(torch.randint(0, bs + 1, (1,), generator=g))
        loc = torch.randint(1, 10**6, (rows,), generator=g)
        loc[int(qo[real]):] = 0  # the padded requests' slots
        loc[torch.rand(rows, generator=g) < 0.05] = 0  # a zero slot elsewhere counts as a padded row
        prefix = torch.randint(0, 70000, (bs,), generator=g)
        kv = torch.cat([torch.zeros(1, dtype=torch.int64), prefix.cumsum(0)])
        tail = 5  # metadata buffers longer than the batch (SGLang's are sized for the largest capture)
        qo_buf = torch.cat([qo, torch.full((tail,), 7)]).to(idx_dtype)
        kv_buf = torch.cat([kv, torch.full((tail,), 3)]).to(idx_dtype)
        loc_buf = torch.cat([loc, torch.full((tail,), 9)])
        cases.append((qo_buf, kv_buf, None if none_loc else loc_buf, bs, draft, rows))
    return cases


INTERP_SCRIPT = r'''
import json, sys
from shadowd.sglang.padding import graph_shape_torch
from shadowd.sglang.triton_padding import graph_shape_fused
from tests.sglang.test_padding import _random_cases
pairs = [[graph_shape_fused(*c).tolist(), graph_shape_torch(*c).tolist()] for c in _random_cases(int(sys.argv[1]))]
print("RESULT " + json.dumps(pairs))
'''

# on the GPU: graph_shape is one kernel, equals the torch ops eagerly, and each replay of a graph that captured it
# reads the batch then in its buffers (new write slots and prefix lengths)
GPU_SCRIPT = r'''
import json
import torch
from torch.profiler import ProfilerActivity, profile
from shadowd.sglang.padding import graph_shape, graph_shape_torch, warm_graph_shape
from tests.sglang.test_padding import _random_cases
out = []
for case in _random_cases(2):
    qo, kv, loc, bs, draft, rows = (c.cuda() if isinstance(c, torch.Tensor) else c for c in case)
    warm_graph_shape(qo, kv, loc)  # compiled as SGLang's eager warm-up does, not by the profiled call
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        eager = graph_shape(qo, kv, loc, bs, draft, rows)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    row = {"kernels": kernels, "eager": [eager.tolist(), graph_shape_torch(*case).tolist()], "replays": []}
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        meta = graph_shape(qo, kv, loc, bs, draft, rows)
    for seed in (3, 4):
        g = torch.Generator().manual_seed(seed)
        if loc is not None:
            fresh = loc.cpu()
            fresh[:rows][torch.rand(rows, generator=g) < 0.5] = 0
            loc.copy_(fresh)
        kv.copy_((kv.cpu() + torch.randint(0, 3, kv.shape, generator=g).cumsum(0)).to(kv.dtype))
        graph.replay()
        want = graph_shape_torch(qo.cpu(), kv.cpu(), None if loc is None else loc.cpu(), bs, draft, rows)
        row["replays"].append([meta.tolist(), want.tolist()])
    out.append(row)
print("RESULT " + json.dumps(out))
'''


# the kernel compiled for real GPUs on this machine (Triton's bundled ptxas; the interpreter, which the test above
# uses, accepts code the compiler refuses): every metadata dtype SGLang may hand it, for sm_90 and sm_120
BUILD_SCRIPT = r'''
import json
from pathlib import Path
import triton
import triton.backends.nvidia as nv
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from shadowd.sglang.triton_padding import BLOCK, _graph_shape_kernel
if not (Path(nv.__file__).parent / "bin" / "ptxas").exists():
    print("RESULT " + json.dumps({"skip": "Triton's ptxas is not installed"}))
    raise SystemExit
built = []
for arch in (90, 120):
    for idx in ("*i32", "*i64"):
        for loc, has_loc in (("*i64", True), ("*i32", True), (idx, False)):
            sig = {"qo_ptr": idx, "kv_ptr": idx, "loc_ptr": loc, "meta_ptr": "*i64", "bs": "i32", "draft": "i32",
                   "rows": "i32", "HAS_LOC": "constexpr", "BLOCK": "constexpr"}
            src = ASTSource(_graph_shape_kernel, sig, constexprs={"HAS_LOC": has_loc, "BLOCK": BLOCK})
            k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": 4})
            built.append([arch, idx, loc, has_loc, len(k.asm["cubin"]) > 0])
print("RESULT " + json.dumps(built))
'''


def _run(tmp_path: Path, script: str, *args: str, interpret: bool) -> Any:
    path = tmp_path / "padding_check.py"
    path.write_text(script)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # (this package's conftest sets it)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")])
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, str(path), *args], capture_output=True, text=True, env=env, timeout=300)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(line[0][7:])


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (interpreter)")
def test_the_fused_kernel_equals_the_torch_ops_in_the_interpreter(tmp_path: Path) -> None:
    cases = _random_cases(1)
    pairs = _run(tmp_path, INTERP_SCRIPT, "1", interpret=True)
    assert len(pairs) == len(cases)
    for i, (fused, ref) in enumerate(pairs):
        assert fused == ref, f"case {i}: fused {fused} != torch {ref}"
    # the cases reach what they are meant to: padded requests and rows, and batches without padding
    assert any(ref[0] < c[3] for (_, ref), c in zip(pairs, cases, strict=True))
    assert any(ref[3] < c[5] for (_, ref), c in zip(pairs, cases, strict=True))
    assert any(ref[0] == c[3] for (_, ref), c in zip(pairs, cases, strict=True))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_the_fused_kernel_compiles_for_sm90_and_sm120(tmp_path: Path) -> None:
    built = _run(tmp_path, BUILD_SCRIPT, interpret=False)
    if isinstance(built, dict):
        pytest.skip(built["skip"])
    assert len(built) == 12 and all(b[-1] for b in built), built


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_graph_shape_is_one_kernel_and_each_replay_reads_its_own_batch(tmp_path: Path) -> None:
    rows = _run(tmp_path, GPU_SCRIPT, interpret=False)
    assert len(rows) == len(_random_cases(2))
    for i, row in enumerate(rows):
        assert len(row["kernels"]) == 1 and "graph_shape" in row["kernels"][0], (i, row["kernels"])
        assert row["eager"][0] == row["eager"][1], (i, row["eager"])
        for got, want in row["replays"]:
            assert got == want, (i, got, want)
    assert any(r["replays"][0][1] != r["replays"][1][1] for r in rows), "replays saw different batches"
