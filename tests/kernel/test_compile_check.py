"""The compile-only resource check (nvcc, no GPU): sm_120 build has no spills and fits 101376 B smem."""

from __future__ import annotations

import pytest
from mla_tree_verify import compile_check
from mla_tree_verify._build import find_nvcc

SAMPLE = """ptxas info    : Compiling entry function '_ZN3mtv14mtv_fwd_kernelE7MtvArgs' for 'sm_120'
ptxas info    : Function properties for _ZN3mtv14mtv_fwd_kernelE7MtvArgs
    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 1024 bytes smem
"""


def test_parse_and_fail_on_spills():
    reps = compile_check.parse_ptxas(SAMPLE)
    assert len(reps) == 1 and reps[0].kernel == "mtv_fwd_kernel" and reps[0].registers == 255
    reps[0].dynamic_smem = 101000
    fails = compile_check.check(reps)
    text = " ".join(fails)
    assert "spills" in text and "stack" in text and "102024" in text and "mtv_fwd_kernel" in text


@pytest.mark.skipif(find_nvcc() is None, reason="nvcc not installed")
def test_compile_check_passes(capsys):
    rc = compile_check.main([])
    out = capsys.readouterr().out
    assert rc == 0, out
    # both S layouts, each with the one-split and the split epilogue
    assert "sm_120" in out and all(f"mtv_fwd_kernel<{g},{s}>" in out for g in (2, 4) for s in (0, 1))
    # the combine's four column-slice instantiations are checked too
    assert all(f"mtv_combine_kernel<{s}>" in out for s in (1, 2, 4, 8))


def test_demangle_names_template_instantiations():
    # both instantiations of the forward kernel are reported (and checked) separately
    assert compile_check.demangle("_ZN3mtv14mtv_fwd_kernelILi4EEEv7MtvArgs") == "mtv_fwd_kernel<4>"
    assert compile_check.demangle("_ZN3mtv14mtv_fwd_kernelILi2EEEv7MtvArgs") == "mtv_fwd_kernel<2>"
    # (S layout, split epilogue): every argument is kept, in order
    assert compile_check.demangle("_ZN3mtv14mtv_fwd_kernelILi2ELi1EEEv7MtvArgs") == "mtv_fwd_kernel<2,1>"
    assert compile_check.demangle("_ZN3mtv18mtv_combine_kernelE7MtvArgs") == "mtv_combine_kernel"


def test_a_nvcc_variable_that_is_no_compiler_is_named_not_passed_over(monkeypatch, capsys):
    # (it fell through to another nvcc: a build of something other than asked for)
    monkeypatch.setenv("NVCC", "/nonexistent/nvcc")
    with pytest.raises(RuntimeError, match=r"\$NVCC is '/nonexistent/nvcc', which is not an executable file"):
        find_nvcc()
    assert compile_check.main([]) == 2
    assert "$NVCC is '/nonexistent/nvcc'" in capsys.readouterr().err


def test_the_build_command_takes_gencode_in_nvccs_own_form(monkeypatch, capsys):
    from mla_tree_verify import build as build_cli

    asked: list[tuple[str, ...]] = []
    monkeypatch.setattr(build_cli, "build", lambda gencode, force, verbose: asked.append(gencode) or "lib.so")
    argv = ["--gencode=arch=compute_90,code=sm_90", "--gencode=-gencode=arch=compute_120,code=sm_120"]
    assert build_cli.main(argv) == 0
    assert asked == [("-gencode=arch=compute_90,code=sm_90", "-gencode=arch=compute_120,code=sm_120")]


@pytest.mark.skipif(find_nvcc() is None, reason="nvcc not installed")
def test_compile_check_shows_nvccs_own_error(monkeypatch, capsys):
    monkeypatch.setenv("MLA_TREE_VERIFY_NVCC_FLAGS", "--no-such-nvcc-flag")
    assert compile_check.main([]) == 2
    err = capsys.readouterr().err
    assert "no-such-nvcc-flag" in err.split("returned non-zero exit status")[-1], err
