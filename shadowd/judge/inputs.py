"""What the judge reads: a snapshot of one run's rollups (plain data, no database).

The collector builds a :class:`RunRollups` from its rollup tables (never from raw samples)
and hands it to the judge's pure functions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["RunRollups", "StepCounts"]


@dataclass(frozen=True)
class StepCounts:
    """Verify steps of a run: all, and those in which any call exceeded under ``policy_hash``.

    ``policy_hash`` is the policy the per-call ``exceeded`` flags were computed under at
    ingest ("mixed" when the policy changed during the run): the count is exact only when
    it equals the hash of the policy being judged.
    """

    total: int
    exceeded: int
    policy_hash: str
    recent_total: int = 0
    recent_exceeded: int = 0


@dataclass(frozen=True)
class RunRollups:
    """One run's rollups.

    - ``run``: the run row (id, run_key, num_layers, tp_size, candidate_fingerprint, n_samples,
      n_errors, n_cand_nonfinite, n_base_nonfinite, n_requests, n_oracle, first_sample_ts,
      last_sample_ts, ...).
    - ``cells``: rows of rollup_cells — per (layer, bs_bucket, t_bucket, prefix_bucket, heads):
      counters n, n_exceed, n_error, n_cand_nonfinite, n_base_nonfinite, n_nan_stat, numel,
      n_oracle, n_timed, n_nan_unexplained (calls with a non-finite statistic that no non-finite output or error
      of their own explains); sums sum_max_abs, sum_rel_l2, sum_cos_diff, sum_scaled, sum_cand_us,
      sum_base_us; maxima max_max_abs, max_rel_l2, max_cos_diff, max_max_rel, max_scaled,
      max_oracle_cand, max_oracle_base, max_oracle_ratio; first_ts, last_ts.
    - ``slots``: rows of rollup_time — per (layer, t) with the same counters/sums/maxima.
    - ``hists``: {(layer, stat): {bin: count}} with stat in max_abs, rel_l2, cos_diff, scaled,
      oracle_ratio (quarter-octave bins, see shadowd.judge.bins); a stat ending in ``:oct`` holds
      octave bins, and layer -1 (``RUN_WIDE``) all layers together. The collector stores run-wide
      quarter-octave and per-layer octave histograms of the four statistics, and per-layer
      quarter-octave ones of the oracle ratio.
    - ``steps``: verify-step counts.
    - ``now``: the evaluation time (unix seconds, the collector's clock).
    - :attr:`recent_end`: where recency windows end: ``now``, or the run's newest sample when that is earlier,
      so a run whose traffic stopped (a cutover restarts the server) keeps the verdict of its data rather than
      turning INSUFFICIENT_DATA a window later. (No producer clock moves it past ``now``, and ingest refuses
      sample times more than ``SHADOWD_MAX_CLOCK_SKEW_S`` ahead of the collector's.)
    - ``time_bucket_s``: the width of rollup_time's buckets (the collector's ``SHADOWD_TIME_BUCKET_S``).
    - ``errors``: candidate errors per kind (the samples' ``error`` marker → count), from rollup_errors.
    - ``ranks``: rows of rollup_ranks — per (rank, layer): ``n`` calls that compared something, ``n_empty``
      calls that compared nothing (stored, no evidence), first_ts, last_ts.
    - ``producers``: the run's producer rows (one per process; a restarted rank is a new producer): stage
      (pipeline stage, 0 without pipeline parallelism), rank, producer, disabled, fallback, disabled_reason,
      fallback_reason, first_seen, last_seen, ...
    """

    run: dict[str, Any]
    cells: list[dict[str, Any]]
    slots: list[dict[str, Any]]
    hists: dict[tuple[int, str], dict[int, int]]
    steps: StepCounts
    now: float
    history: list[dict[str, Any]] = field(default_factory=list)  # earlier stored evaluations, oldest first
    errors: dict[str, int] = field(default_factory=dict)
    ranks: list[dict[str, Any]] = field(default_factory=list)
    producers: list[dict[str, Any]] = field(default_factory=list)
    time_bucket_s: float = 60.0

    @property
    def recent_end(self) -> float:
        last = self.run.get("last_sample_ts")
        return self.now if last is None else min(self.now, float(last))
