"""shadowd's SGLang integration: a plugin (entry point group ``sglang.srt.plugins``) that shadows
the target model's MLA tree-verify attention inside every SGLang worker process.

* :mod:`shadowd.sglang.plugin` — ``register()``, the entry point;
* :mod:`shadowd.sglang.verify` — the AROUND hook on ``TritonAttnBackend.forward_extend``;
* :mod:`shadowd.sglang.candidate` — baseline (SGLang's Triton path) and candidate (``mla_tree_verify``);
* :mod:`shadowd.sglang.process` — per-process runtime, rank, run registration, streamer;
* :mod:`shadowd.sglang.graphs` — the CUDA-graph safety check;
* :mod:`shadowd.sglang.spec` — speculative accept length per mode;
* :mod:`shadowd.sglang.compat` — the tested SGLang range.

Nothing here imports sglang at module import time except where a hook runs.
"""

__all__: list[str] = []
