"""``python -m mla_tree_verify.build [--force]``: compile the CUDA library into the cache."""

from __future__ import annotations

import argparse
import sys

from ._build import DEFAULT_GENCODE, build


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mla_tree_verify.build", description=__doc__)
    ap.add_argument("--force", action="store_true", help="rebuild even if a cached library exists")
    ap.add_argument("--gencode", action="append", metavar="arch=compute_XX,code=sm_XX",
                    help="override nvcc's -gencode flags (repeatable; the value as nvcc's -gencode takes it, with or "
                         "without a leading -gencode=)")
    ns = ap.parse_args(argv)
    gencode = tuple(g if g.startswith("-") else f"-gencode={g}" for g in ns.gencode) if ns.gencode else DEFAULT_GENCODE
    try:
        path = build(gencode, force=ns.force, verbose=True)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
