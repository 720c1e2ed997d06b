"""``python -m mla_tree_verify.build [--force]``: compile the CUDA library into the cache."""

from __future__ import annotations

import argparse
import sys

from ._build import DEFAULT_GENCODE, build


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mla_tree_verify.build", description=__doc__)
    ap.add_argument("--force", action="store_true", help="rebuild even if a cached library exists")
    ap.add_argument("--gencode", action="append", help="override nvcc -gencode flags (repeatable)")
    ns = ap.parse_args(argv)
    gencode = tuple(ns.gencode) if ns.gencode else DEFAULT_GENCODE
    try:
        path = build(gencode, force=ns.force, verbose=True)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
