"""CPU benchmark of the SGLang verify site's own host work per layer call (its bookkeeping around the hook).

An eager verify step calls the site once per layer; every call decides whether it is shadowed (the eligibility
check) and what shape it has (the bucket). Both are the same for every layer of a step, and the layer's part of
the eligibility never changes once the model is loaded, so the site computes them once (per step, per layer) and
reuses them. Measured here, on the real sglang objects the plugin tests build (``tests/sglang/builders.py``,
CPU, a (1, 4096, 8, 8) step), best of 5 repeats, µs per call:

* the eligibility check computed whole (``ineligible``) vs. as the site makes it (the layer part cached);
* the bucket of a step's first layer (made) vs. of its other layers (reused).

Needs sglang installed (``scripts/install-sglang-cpu.sh``). Appends to ``bench/results/sglang-<date>.md``
(``--no-write`` to skip).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before sglang defines its Triton kernels (no GPU here)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.hook_overhead import append_dated, cpu_header, per_call


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from tests.sglang import torchvision_stub

    torchvision_stub.install()
    import sglang.srt.layers.attention.triton_backend as tb

    from shadowd.sglang.verify import VerifyShadow, _call_reason, _step_reason, ineligible
    from tests.sglang.builders import make_case

    case = make_case(tb, layers=2, heads=8, prefix=(4096,), draft=8, slots=4200)
    shadow = VerifyShadow()
    site = shadow._site(case.backend)
    md = case.backend.forward_metadata
    q, k, layer, fb = case.q[0], case.k[0], case.layers[0], case.forward_batch
    n = 20_000

    def whole() -> object:
        return ineligible(case.backend, q, k, k, layer, fb)

    def cached() -> object:
        return (_step_reason(case.backend, fb) or shadow._layer_reason(case.backend, layer)
                or _call_reason(q, k, k, fb, None, None, None))

    def first_layer() -> object:
        fb._shadowd_bucket = None  # as a new step finds it
        return VerifyShadow._bucket(q, 8, fb, md, site, 0)

    def other_layer() -> object:
        return VerifyShadow._bucket(q, 8, fb, md, site, 1)

    assert whole() is None and cached() is None, "the bench's step must be one the site shadows"
    t_whole, t_cached = per_call(whole, n), per_call(cached, n)
    t_first, t_other = per_call(first_layer, n), per_call(other_layer, n)
    head, now = cpu_header("sglang_site_host.py")
    text = (head + "The SGLang verify site's bookkeeping per layer call, (1, 4096, 8, 8), µs per call (best of 5):\n\n"
            f"- eligibility computed whole: {t_whole * 1e6:.2f}; as the site makes it (layer part cached): "
            f"{t_cached * 1e6:.2f} ({t_cached / t_whole:.2f}×)\n"
            f"- bucket of a step's first layer (made): {t_first * 1e6:.2f}; of its other layers (reused): "
            f"{t_other * 1e6:.2f} ({t_other / t_first:.2f}×)\n")
    print(text)
    if not args.no_write:
        append_dated("sglang", now, "\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
