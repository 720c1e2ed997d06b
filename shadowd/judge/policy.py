"""The readiness policy: tolerances and statistical knobs, with defaults per output dtype.

A policy is read from a TOML or JSON file (``SHADOWD_POLICY_FILE``) or built from the
defaults of the output dtype (bf16 unless the file says otherwise). Its hash is stored with
every evaluation and with each run's exact exceeding-step count, so a changed policy is
visible and old counts are never silently reused.

Why the bf16 defaults are what they are: one bf16 rounding of the output gives a relative
error up to 2^-9 per element; two different correct kernels differ by about the sum of their
two roundings plus fp32 accumulation-order noise. SGLang's Triton path measures rel-L2
≈ 2e-3 against an fp32 oracle (../shared/CONTEXT.md §4), so candidate-vs-baseline rel-L2 of
correct kernels lands near 3e-3. The defaults leave a factor ~5 of headroom: rel-L2 ≤ 1.6e-2
(torch.testing's bf16 rtol), cosine difference ≤ 1.28e-4 (= rel-L2² / 2 at that bound), and
max-abs ≤ 2^-5 of the output's scale (8 bf16 ulps at the largest element).
"""

from __future__ import annotations

import hashlib
import json
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

__all__ = ["DTYPE_DEFAULTS", "ENV_PREFIX", "Policy", "PolicyError", "load_policy", "policy_from_env"]

Dtype = Literal["bf16", "fp16", "fp32"]

ENV_PREFIX = "SHADOWD_POLICY_"

#: tolerances per output dtype: rel-L2, cosine difference, max-abs / output scale, ulp (relative)
DTYPE_DEFAULTS: dict[str, dict[str, float]] = {
    "bf16": {"rel_l2_max": 1.6e-2, "cos_diff_max": 1.28e-4, "scaled_max_abs_max": 2.0**-5, "ulp": 2.0**-8},
    "fp16": {"rel_l2_max": 1e-3, "cos_diff_max": 5e-7, "scaled_max_abs_max": 2.0**-8, "ulp": 2.0**-11},
    "fp32": {"rel_l2_max": 1.3e-6, "cos_diff_max": 1e-12, "scaled_max_abs_max": 2.0**-18, "ulp": 2.0**-24},
}


class Policy(BaseModel):
    """Readiness policy. Unset tolerances take the defaults of ``dtype``.

    Every knob is a finite number in its range (or the dtype's name): an infinite tolerance would turn a check of
    the verdict off without saying so, and ``true`` is not a number (TOML and JSON booleans are refused, not read
    as 1)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    dtype: Dtype = "bf16"
    rel_l2_max: float | None = Field(default=None, gt=0, description="per-call rel-L2 tolerance")
    cos_diff_max: float | None = Field(default=None, gt=0, description="per-call cosine-difference tolerance")
    scaled_max_abs_max: float | None = Field(
        default=None, gt=0, description="per-call max-abs divided by the output's scale (max |baseline|)"
    )
    oracle_k: float = Field(default=2.0, gt=0, description="cand-vs-oracle error ≤ k × baseline's + ulp floor")
    target_rate: float = Field(default=1e-4, gt=0, lt=1, description="largest acceptable exceeding-step rate")
    confidence: float = Field(default=0.99, gt=0.5, lt=1, description="confidence of the binomial bounds")
    min_requests: int = Field(default=1000, ge=0, description="distinct requests before READY")
    min_span_s: float = Field(default=3600.0, ge=0, description="traffic time span before READY, seconds")
    min_cell_samples: int = Field(default=100, ge=1, description="samples per layer and per shape bucket")
    drift_window_s: float = Field(default=900.0, gt=0, description="recent window compared with history")
    drift_ratio: float = Field(default=2.0, gt=1, description="recent mean error ≤ history × ratio")
    drift_min_samples: int = Field(default=200, ge=1, description="samples per side to judge drift")
    hysteresis_k: int = Field(default=4, ge=1, description="consecutive passing evaluations before READY")
    hysteresis_minutes: float = Field(default=30.0, ge=0, description="span those evaluations must cover")

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans(cls, value: Any) -> Any:
        if isinstance(value, bool):
            raise ValueError(f"{str(value).lower()} is not a knob's value (a number, or dtype's name)")
        return value

    def tol(self, name: str) -> float:
        """The effective tolerance ``name`` (explicit value, else the dtype default)."""
        value = getattr(self, name, None)
        return float(value) if value is not None else DTYPE_DEFAULTS[self.dtype][name]

    @property
    def ulp(self) -> float:
        return DTYPE_DEFAULTS[self.dtype]["ulp"]

    def effective(self) -> dict[str, Any]:
        """All knobs with the dtype defaults filled in (what reports show)."""
        out = self.model_dump()
        for name in ("rel_l2_max", "cos_diff_max", "scaled_max_abs_max"):
            out[name] = self.tol(name)
        out["ulp"] = self.ulp
        return out

    def hash(self) -> str:
        """Stable identity of the tolerances that decide per-call exceedance (the key of the stored
        per-call ``exceeded`` flags: other knobs do not change them)."""
        keys = ("dtype", "rel_l2_max", "cos_diff_max", "scaled_max_abs_max", "oracle_k")
        eff = self.effective()
        blob = json.dumps({k: eff[k] for k in keys}, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def identity(self) -> str:
        """Stable identity of the whole policy, every knob: what hysteresis compares, so that passing
        evaluations made under another policy (a looser confidence, another target, a shorter span) never
        count toward READY under this one."""
        blob = json.dumps(self.effective(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def exceeds(self, cols: dict[str, np.ndarray]) -> np.ndarray:
        """Per call: does it exceed tolerance or fail hard? (vectorised over a batch)

        NaN in any error statistic counts as exceeding (NaN never passes), except in a call whose
        baseline alone is non-finite: that is a baseline event, not the candidate's failure.
        """
        rel = cols["rel_l2"]
        cos = cols["cos_diff"]
        max_abs = cols["max_abs"]
        scale = cols["out_scale"]
        with np.errstate(divide="ignore", invalid="ignore"):
            scaled = np.where(scale > 0, max_abs / np.where(scale > 0, scale, 1.0), max_abs)
            bad = rel > self.tol("rel_l2_max")
            bad |= cos > self.tol("cos_diff_max")
            bad |= scaled > self.tol("scaled_max_abs_max")
            nan = np.isnan(rel) | np.isnan(cos) | np.isnan(scaled)
            # a call whose baseline alone is non-finite is a baseline event: NaN statistics there are
            # not held against the candidate (finite statistics beyond tolerance still are)
            base = cols.get("base_nonfinite")
            if base is not None:
                nan &= ~((base > 0) & (cols["cand_nonfinite"] == 0))
            bad |= nan
            bad |= cols["cand_nonfinite"] > 0
            bad |= cols["error_flag"]
            oc = cols.get("oracle_cand_err")
            ob = cols.get("oracle_base_err")
            if oc is not None and ob is not None:
                has = ~np.isnan(ob) & ~np.isnan(oc)  # both sides sampled against the oracle
                floor = self.ulp * np.where(np.isfinite(scale), scale, 0.0)
                bad |= has & ~(oc <= self.oracle_k * ob + floor)
        return np.asarray(bad, dtype=bool)


def policy_from_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Knobs set in the environment as ``SHADOWD_POLICY_<KNOB>`` (e.g. ``SHADOWD_POLICY_TARGET_RATE``).

    ``SHADOWD_POLICY_FILE`` names the file and is not a knob.
    """
    env = os.environ if environ is None else environ
    out: dict[str, str] = {}
    for name in Policy.model_fields:
        value = env.get(ENV_PREFIX + name.upper())
        if value is not None and value != "":
            out[name] = value
    return out


def load_policy(path: Path | str | None, environ: Mapping[str, str] | None = None) -> Policy:
    """The policy in force: the file's knobs (TOML, or JSON by suffix), then ``SHADOWD_POLICY_*`` overrides.

    With no file and no environment overrides: the bf16 defaults. ``environ`` defaults to
    ``os.environ``; pass ``{}`` to ignore the environment.
    """
    data: dict[str, Any] = {}
    if path is not None:
        kind = "TOML" if Path(path).suffix.lower() == ".toml" else "JSON"
        try:
            text = Path(path).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise PolicyError(f"policy file {path}: not UTF-8 text") from None
        except IsADirectoryError:
            raise PolicyError(f"policy file {path}: a directory, not a file") from None
        try:
            data = tomllib.loads(text) if kind == "TOML" else json.loads(text)
        except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
            raise PolicyError(f"policy file {path}: not valid {kind}: {exc}") from None
        if not isinstance(data, dict):
            raise PolicyError(f"policy file {path}: expected a table of knobs (an object), got {type(data).__name__}")
        data.pop("description", None)
    env = policy_from_env(environ)
    data.update(env)
    try:
        return Policy.model_validate(data)
    except ValidationError as exc:
        if path is None:
            where = "SHADOWD_POLICY_* environment"
        else:
            where = f"policy file {path}" + (" or SHADOWD_POLICY_*" if env else "")
        knobs = "; ".join(f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']}" for e in exc.errors())
        raise PolicyError(f"{where}: {knobs}") from None


class PolicyError(ValueError):
    """A policy file or ``SHADOWD_POLICY_*`` value that cannot be used; the message names the file and knob."""
