"""The selftest sweep on the CPU: a correct implementation passes, a wrong one fails, no GPU refuses."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from mla_tree_verify import reference  # noqa: E402

from shadowd.selftest import default_sweep, run_selftest, selftest_main  # noqa: E402

SMALL = [
    {"prefix_lens": [0, 1, 37], "tree_sizes": [1, 8, 5], "heads": 4, "tree_kind": "random"},
    {"prefix_lens": [200], "tree_sizes": [33], "heads": 2, "tree_kind": "star", "logit_std": 8.0},
    {"prefix_lens": [64, 3], "tree_sizes": [6, 9], "heads": 3, "use_mask": False},
]


def _correct(*args, max_q_len=None):
    return reference.attention(*args)


def test_a_correct_cpu_implementation_passes_the_sweep():
    lines = []
    report = run_selftest(_correct, "cpu", SMALL, echo=lines.append, time_it=False)
    assert report.passed, lines
    assert len(lines) == len(SMALL) and all("PASS" in line for line in lines)


def test_a_biased_or_crashing_candidate_fails():
    def biased(*args, max_q_len=None):
        return reference.attention(*args) + 0.05

    def crashing(*args, max_q_len=None):
        raise RuntimeError("illegal memory access")

    assert not run_selftest(biased, "cpu", SMALL[:1], echo=lambda s: None, time_it=False).passed
    lines = []
    report = run_selftest(crashing, "cpu", SMALL[:2], echo=lines.append, time_it=False)
    assert not report.passed and len(report.results) == 2 and "illegal memory access" in lines[0]


def test_a_candidate_raising_its_words_on_valid_input_fails():
    # selftest hands the kernel its error and non-finite words, as the SGLang site does: a raised error bit would
    # disable it in serving, a non-finite word over a finite output would make the hook check calls for nothing
    def honest(*args, max_q_len=None, error_flag=None, nonfinite_flag=None):
        return reference.attention(*args)

    def flags_errors(*args, max_q_len=None, error_flag=None, nonfinite_flag=None):
        error_flag.fill_(4)
        return reference.attention(*args)

    def flags_nonfinite(*args, max_q_len=None, error_flag=None, nonfinite_flag=None):
        nonfinite_flag.fill_(1)
        return reference.attention(*args)

    assert run_selftest(honest, "cpu", SMALL[:1], echo=lambda s: None, time_it=False, words=True).passed
    for fn, why in ((flags_errors, "error_flag 0x4 raised on valid input"),
                    (flags_nonfinite, "nonfinite_flag raised over a finite output")):
        lines = []
        report = run_selftest(fn, "cpu", SMALL[:1], echo=lines.append, time_it=False, words=True)
        assert not report.passed and why in lines[0], lines


def test_sweep_covers_the_contract_shapes():
    specs = default_sweep()
    assert any(257 in s["tree_sizes"] for s in specs)
    assert any(0 in s["prefix_lens"] for s in specs) and any(1 in s["prefix_lens"] for s in specs)
    assert any(s.get("use_mask") is False for s in specs)
    assert max(s["heads"] for s in specs) >= 64


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_selftest_without_cuda_exits_2():
    lines = []
    assert selftest_main(echo=lines.append) == 2
    assert "CUDA" in lines[0]


@pytest.mark.parametrize(("cap", "runs"), [((9, 0), True), ((12, 0), True), ((12, 1), True), ((13, 0), True),
                                           ((8, 9), False), ((8, 0), False), ((10, 0), False), ((11, 0), False)])
def test_the_kernel_build_says_which_gpus_it_has_code_for(cap, runs):
    from mla_tree_verify import _build

    # sm_90 and sm_120 cubins, compute_120 PTX: sm_121 runs the sm_120 cubin, a later part JIT-compiles the PTX,
    # Ada / Ampere / sm_100 have nothing
    assert _build.runs_on(cap) is runs
    assert _build.targets() == "sm_90, sm_120, compute_120 (PTX)"


def test_selftest_on_a_gpu_outside_the_build_targets_says_so_without_building(monkeypatch):
    from mla_tree_verify import _lib

    monkeypatch.delenv("MLA_TREE_VERIFY_LIB", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA L40S")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 9))

    def no_build():
        raise AssertionError("built for a GPU it cannot run on")

    monkeypatch.setattr(_lib, "load", no_build)
    lines = []
    assert selftest_main(echo=lines.append) == 1
    assert "NVIDIA L40S is sm_89" in lines[-1] and "sm_90, sm_120, compute_120 (PTX)" in lines[-1], lines
