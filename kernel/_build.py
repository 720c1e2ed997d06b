"""Locating nvcc, compiling csrc/ into a shared library, and caching it.

Nothing here runs at ``pip install`` time.  The library is built on first use (or by
``python -m mla_tree_verify.build``) into ``$MLA_TREE_VERIFY_CACHE`` (default
``~/.cache/mla_tree_verify``), in a directory keyed by the hash of every source file and the
target list, so an edited source or another nvcc target set builds a new library.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

CSRC = Path(__file__).resolve().parent / "csrc"
MAIN_SOURCE = CSRC / "mla_tree_verify.cu"
LIB_NAME = "libmla_tree_verify.so"
# sm_120 (target) and sm_90 (H100/H200) machine code, plus compute_120 PTX for newer parts.
DEFAULT_GENCODE = (
    "-gencode=arch=compute_90,code=sm_90",
    "-gencode=arch=compute_120,code=sm_120",
    "-gencode=arch=compute_120,code=compute_120",
)
BASE_FLAGS = ("-O3", "-std=c++17", "-lineinfo", "--expt-relaxed-constexpr")
# Extra nvcc flags (e.g. tile-shape variants "-DMTV_BN=16 -DMTV_STAGES=4"); part of the cache key.
EXTRA_FLAGS_ENV = "MLA_TREE_VERIFY_NVCC_FLAGS"


def extra_flags() -> tuple[str, ...]:
    return tuple(os.environ.get(EXTRA_FLAGS_ENV, "").split())


def find_nvcc() -> str | None:
    """Path of nvcc: $NVCC, $CUDA_HOME/bin/nvcc, PATH, /usr/local/cuda/bin/nvcc; else None. A $NVCC that is set but
    is no executable file raises RuntimeError naming it (another nvcc found instead would build something else
    than asked for)."""
    nvcc = os.environ.get("NVCC")
    if nvcc:
        if os.path.isfile(nvcc) and os.access(nvcc, os.X_OK):
            return nvcc
        raise RuntimeError(f"$NVCC is {nvcc!r}, which is not an executable file (unset it to search $CUDA_HOME, PATH "
                           "and /usr/local/cuda)")
    cands: list[str | None] = []
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            cands.append(os.path.join(os.environ[env], "bin", "nvcc"))
    cands.append(shutil.which("nvcc"))
    cands.append("/usr/local/cuda/bin/nvcc")
    for c in cands:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


def _arch(code: str) -> tuple[int, int]:
    digits = code.split("_")[-1].rstrip("af")
    return int(digits[:-1]), int(digits[-1])


def runs_on(capability: tuple[int, int], gencode: tuple[str, ...] = DEFAULT_GENCODE) -> bool:
    """Whether a library built with ``gencode`` has code for a GPU of this compute capability: a cubin of the
    same major version and a minor version no newer (sm_120 machine code runs on sm_121), or PTX of a virtual
    architecture no newer than the GPU (compute_120 is JIT-compiled on sm_12x and later, never on sm_100)."""
    cap = (int(capability[0]), int(capability[1]))
    for g in gencode:
        code = g.split("code=")[-1]
        arch = _arch(code)
        if code.startswith("sm_") and arch[0] == cap[0] and arch[1] <= cap[1]:
            return True
        if code.startswith("compute_") and arch <= cap:
            return True
    return False


def targets(gencode: tuple[str, ...] = DEFAULT_GENCODE) -> str:
    """The targets of a build, for messages: ``sm_90, sm_120, compute_120 (PTX)``."""
    return ", ".join(g.split("code=")[-1] + (" (PTX)" if "code=compute_" in g else "") for g in gencode)


def source_files() -> list[Path]:
    return sorted(p for p in CSRC.rglob("*") if p.suffix in {".cu", ".cuh", ".h"})


def source_hash(gencode: tuple[str, ...] = DEFAULT_GENCODE) -> str:
    h = hashlib.sha256()
    for p in source_files():
        h.update(str(p.relative_to(CSRC)).encode())
        h.update(p.read_bytes())
    h.update(" ".join(gencode + BASE_FLAGS + extra_flags()).encode())
    return h.hexdigest()[:16]


def cache_root() -> Path:
    return Path(os.environ.get("MLA_TREE_VERIFY_CACHE", Path.home() / ".cache" / "mla_tree_verify"))


def library_path(gencode: tuple[str, ...] = DEFAULT_GENCODE) -> Path:
    tag = "-".join(g.split("code=")[-1] for g in gencode)
    return cache_root() / f"{source_hash(gencode)}-{tag}" / LIB_NAME


def nvcc_command(nvcc: str, out: Path, gencode: tuple[str, ...], extra: tuple[str, ...] = ()) -> list[str]:
    return [
        nvcc,
        *BASE_FLAGS,
        *extra_flags(),
        *gencode,
        *extra,
        "-shared",
        "-Xcompiler",
        "-fPIC",
        f"-I{CSRC}",
        f"-I{CSRC / 'common'}",
        "-o",
        str(out),
        str(MAIN_SOURCE),
    ]


def build(gencode: tuple[str, ...] = DEFAULT_GENCODE, force: bool = False, verbose: bool = False) -> Path:
    """Compile the library if it is not cached; return its path.  Raises RuntimeError."""
    target = library_path(gencode)
    if target.exists() and not force:
        return target
    nvcc = find_nvcc()
    if nvcc is None:
        raise RuntimeError(
            "mla_tree_verify: nvcc not found (set $NVCC or $CUDA_HOME) - cannot build the kernel"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        tmp_out = Path(tmp) / LIB_NAME
        cmd = nvcc_command(nvcc, tmp_out, gencode)
        if verbose:
            print(" ".join(cmd))
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"mla_tree_verify: nvcc failed ({proc.returncode}):\n{proc.stderr}")
        os.replace(tmp_out, target)  # atomic: concurrent builders never see a partial file
    return target
