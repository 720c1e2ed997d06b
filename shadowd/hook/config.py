"""Hook configuration from the environment (stdlib only: the GPU side has no pydantic).

| variable | meaning | default |
| --- | --- | --- |
| ``SHADOWD_MODE`` (or the seed's ``KDTREE_VERIFY``) | ``off``, ``validate`` or ``on`` (``1``: refused) | ``off`` |
| ``SHADOWD_SAMPLE`` | validate sampling: ``all``, ``1/N`` (N-th steps) or a fraction | ``all`` |
| ``SHADOWD_SPOT_CHECK`` | on-mode spot check: 1 in N steps against the baseline | ``100`` |
| ``SHADOWD_ORACLE`` | 1 in M sampled validate calls also run the fp32 oracle (0 = never) | ``0`` |
| ``SHADOWD_URL`` / ``SHADOWD_TOKEN`` / ``SHADOWD_RUN_KEY`` | collector, bearer token, run key | none |
| ``SHADOWD_SPOOL_DIR`` / ``SHADOWD_SPOOL_MAX_MB`` | on-disk spool of undelivered batches | ``~/.shadowd/spool``, 256 |
| ``SHADOWD_QUEUE_MAX`` | samples held in memory before drops | ``100000`` |
| ``SHADOWD_BUNDLE_DIR`` / ``_MAX`` / ``_MAX_MB`` | repro bundles (unset: none) | none, 20, 2048 |
| ``SHADOWD_HARD_SCALED_MAX_ABS`` / ``SHADOWD_HARD_REL_L2`` | hard limits (fallback, bundles) | ``0.25``, ``0.1`` |
| ``SHADOWD_BUNDLE_REL_L2`` | tolerance above which a bundle is saved | ``0.016`` |
| ``SHADOWD_DISABLE_AFTER`` | consecutive candidate errors that disable it for the process | ``5`` |
| ``SHADOWD_MAX_DRAFT_TOKENS`` / ``SHADOWD_MAX_PREFIX_LEN`` | on-mode coverage (else baseline) | unbounded |
| ``SHADOWD_ORACLE_CHUNK_ROWS`` | query rows per chunk of the oracle (bounds its memory at long prefixes) | ``64`` |
| ``SHADOWD_RANK`` (else ``RANK``) | this process's rank, outside SGLang (the SGLang plugin uses the TP rank) | ``0`` |
| ``SHADOWD_STAGE`` | this process's pipeline stage, outside SGLang (the SGLang plugin uses the PP rank) | ``0`` |
| ``SHADOWD_GATE_RUN`` | on mode: serve the candidate once this validate run is READY for it (``hook.gate``) | none |
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["MODES", "HookConfig", "Sampling", "parse_mode", "parse_sampling"]

MODES = ("off", "validate", "on")
MODE_CODE = {"off": 0, "validate": 1, "on": 2}


def parse_mode(value: str | None) -> str:
    """``off`` / ``validate`` / ``on`` (case-insensitive; ``0`` / ``false`` for off, ``shadow`` for validate);
    raises ValueError otherwise. ``1`` / ``true`` are refused, naming the two modes they could mean: serving the
    candidate must be asked for by name."""
    v = (value or "off").strip().lower()
    if v in ("1", "true", "yes", "enabled"):
        raise ValueError(f"mode {value!r} is ambiguous: say 'validate' (run both, serve the baseline) or 'on' "
                         "(serve the candidate)")
    v = {"0": "off", "false": "off", "shadow": "validate"}.get(v, v)
    if v not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {value!r}")
    return v


@dataclass(frozen=True)
class Sampling:
    """Which verify steps are sampled: every ``every``-th step, or a random ``fraction``."""

    every: int = 1
    fraction: float | None = None

    def every_n(self) -> int:
        """The 1-in-N equivalent (what device-side decisions under CUDA graphs use)."""
        if self.fraction is not None:
            return max(1, round(1.0 / self.fraction)) if self.fraction > 0 else 2**62
        return self.every


def parse_sampling(value: str | None) -> Sampling:
    """``all`` / ``1`` → every step; ``1/N`` → every N-th; ``0 < f < 1`` → a fraction."""
    v = (value or "all").strip().lower()
    if v in ("all", "1", "every"):
        return Sampling(1)
    want = "'all', '1/N' (N a whole number >= 1) or a fraction in [0, 1]"
    if v.startswith("1/"):
        try:
            n = int(v[2:])
        except ValueError:
            raise ValueError(f"sampling must be {want}, got {value!r}") from None
        if n < 1:
            raise ValueError(f"sampling 1/N needs N >= 1, got {value!r}")
        return Sampling(n)
    try:
        f = float(v)
    except ValueError:
        raise ValueError(f"sampling must be {want}, got {value!r}") from None
    if not 0.0 <= f <= 1.0:  # (NaN fails this too)
        raise ValueError(f"sampling fraction must be in [0, 1], got {value!r}")
    return Sampling(1) if f == 1.0 else Sampling(1, f)


def _int(env: Mapping[str, str], key: str, default: int, minimum: int | None = None) -> int:
    """A whole number from ``env[key]`` (unset or empty: ``default``); a bad value raises ValueError naming the
    variable."""
    raw = env.get(key)
    if not raw:
        return default
    try:
        v = int(raw.strip())
    except ValueError:
        raise ValueError(f"{key} must be a whole number, got {raw!r}") from None
    if minimum is not None and v < minimum:
        raise ValueError(f"{key} must be >= {minimum}, got {raw!r}")
    return v


def _float(env: Mapping[str, str], key: str, default: float) -> float:
    """A finite number >= 0 from ``env[key]`` (unset or empty: ``default``); a bad value raises ValueError naming
    the variable (a NaN limit would make every comparison false: no fallback, ever)."""
    raw = env.get(key)
    if not raw:
        return default
    try:
        v = float(raw.strip())
    except ValueError:
        raise ValueError(f"{key} must be a number, got {raw!r}") from None
    if not (math.isfinite(v) and v >= 0.0):
        raise ValueError(f"{key} must be a finite number >= 0, got {raw!r}")
    return v


@dataclass
class HookConfig:
    """Everything the hook reads at start; :meth:`from_env` builds it from the environment."""

    mode: str = "off"
    sampling: Sampling = field(default_factory=Sampling)
    spot_every: int = 100
    oracle_every: int = 0
    oracle_chunk_rows: int = 64
    url: str | None = None
    token: str | None = None
    run_key: str | None = None
    rank: int = 0
    #: the pipeline stage (PP rank): stages run different layers under the same TP ranks, so a producer is
    #: known by (stage, rank) — its spool directory and the collector's producer figures are kept per stage
    stage: int = 0
    spool_dir: Path = field(default_factory=lambda: Path.home() / ".shadowd" / "spool")
    spool_max_bytes: int = 256 * 2**20
    queue_max: int = 100_000
    batch_max: int = 4096
    flush_interval_s: float = 0.25
    poll_interval_s: float = 2.0
    http_timeout_s: float = 5.0
    bundle_dir: Path | None = None
    bundle_max: int = 20
    bundle_max_bytes: int = 2048 * 2**20
    hard_scaled_max_abs: float = 0.25
    hard_rel_l2: float = 0.1
    bundle_rel_l2: float = 1.6e-2
    disable_after: int = 5
    max_draft_tokens: int = 2**31
    max_prefix_len: int = 2**62
    ring_size: int = 4096
    #: on mode: the validate run whose READY verdict opens the promotion gate (None: no gate)
    gate_run: int | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> HookConfig:
        e = os.environ if env is None else env
        mode_key = "SHADOWD_MODE" if e.get("SHADOWD_MODE") else "KDTREE_VERIFY"
        try:
            mode = parse_mode(e.get(mode_key))
        except ValueError as err:
            raise ValueError(f"{mode_key}: {err}") from None
        url = e.get("SHADOWD_URL") or None
        if url is not None:
            from shadowd.client import url_problem

            if (why := url_problem(url)) is not None:
                raise ValueError(f"SHADOWD_URL: {url!r}: {why}")
        bundle = e.get("SHADOWD_BUNDLE_DIR")
        spool = e.get("SHADOWD_SPOOL_DIR")
        try:
            sampling = parse_sampling(e.get("SHADOWD_SAMPLE"))
        except ValueError as err:
            raise ValueError(f"SHADOWD_SAMPLE: {err}") from None
        gate_run = _int(e, "SHADOWD_GATE_RUN", 0, minimum=1) if e.get("SHADOWD_GATE_RUN") else None
        if gate_run is not None and mode == "on" and not e.get("SHADOWD_URL"):
            raise ValueError("SHADOWD_GATE_RUN needs SHADOWD_URL: the gate opens only on the collector's READY "
                             "verdict, so without a collector on mode would never serve the candidate")
        return cls(
            mode=mode,
            sampling=sampling,
            spot_every=_int(e, "SHADOWD_SPOT_CHECK", 100, minimum=1),
            oracle_every=_int(e, "SHADOWD_ORACLE", 0, minimum=0),
            oracle_chunk_rows=_int(e, "SHADOWD_ORACLE_CHUNK_ROWS", 64, minimum=1),
            url=url,
            token=e.get("SHADOWD_TOKEN") or None,
            run_key=e.get("SHADOWD_RUN_KEY") or None,
            rank=_int(e, "SHADOWD_RANK", 0, minimum=0) if e.get("SHADOWD_RANK") else _int(e, "RANK", 0, minimum=0),
            stage=_int(e, "SHADOWD_STAGE", 0, minimum=0),
            spool_dir=Path(spool) if spool else Path.home() / ".shadowd" / "spool",
            spool_max_bytes=_int(e, "SHADOWD_SPOOL_MAX_MB", 256, minimum=0) * 2**20,
            queue_max=_int(e, "SHADOWD_QUEUE_MAX", 100_000, minimum=1),
            bundle_dir=Path(bundle) if bundle else None,
            bundle_max=_int(e, "SHADOWD_BUNDLE_MAX", 20, minimum=0),
            bundle_max_bytes=_int(e, "SHADOWD_BUNDLE_MAX_MB", 2048, minimum=0) * 2**20,
            hard_scaled_max_abs=_float(e, "SHADOWD_HARD_SCALED_MAX_ABS", 0.25),
            hard_rel_l2=_float(e, "SHADOWD_HARD_REL_L2", 0.1),
            bundle_rel_l2=_float(e, "SHADOWD_BUNDLE_REL_L2", 1.6e-2),
            disable_after=_int(e, "SHADOWD_DISABLE_AFTER", 5, minimum=1),
            max_draft_tokens=_int(e, "SHADOWD_MAX_DRAFT_TOKENS", 2**31, minimum=1),
            max_prefix_len=_int(e, "SHADOWD_MAX_PREFIX_LEN", 2**62, minimum=0),
            gate_run=gate_run,
        )

    def covered(self, draft_tokens: int, prefix_len: int) -> bool:
        """Whether on-mode may serve this shape with the candidate."""
        return draft_tokens <= self.max_draft_tokens and prefix_len <= self.max_prefix_len
