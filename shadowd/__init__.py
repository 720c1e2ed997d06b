"""shadowd: shadow-mode numerical diff service for GPU kernels in LLM serving.

The package is split by where it runs:

* ``shadowd.hook`` runs inside the inference server (torch; never FastAPI/SQLAlchemy),
* ``shadowd.collector`` runs where there is no GPU (FastAPI/SQLAlchemy; never torch),
* ``shadowd.judge`` is pure functions over stored rollups,
* ``shadowd.wire`` and ``shadowd.client`` are shared by both sides.
"""

__all__ = ["__version__"]

__version__ = "0.1.0"
