"""Request and response bodies of the read/write API (pydantic)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from shadowd.wire import TS_MAX

__all__ = ["Impl", "IngestAnswer", "ModeChange", "RunCreate", "RunOut"]

#: labels of a run: at most this many, with keys and values of bounded length
LABELS_MAX, LABEL_KEY_MAX, LABEL_VALUE_MAX = 64, 100, 500


def _no_nul(value: Any) -> Any:
    # PostgreSQL text cannot hold NUL characters (SQLite can): refused in every string, on either database
    if isinstance(value, str) and "\x00" in value:
        raise ValueError("must not contain NUL characters")
    return value


def _is_unicode(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


_name = Field(min_length=1, max_length=200)


class _Body(BaseModel):
    """A request body: no unknown fields, no NUL character in any string field."""

    model_config = ConfigDict(extra="forbid")

    @field_validator("*")
    @classmethod
    def _strings(cls, value: Any) -> Any:
        return _no_nul(value)


class Impl(_Body):
    """An implementation under comparison: a name and a fingerprint (build hash + config)."""

    name: str = _name
    fingerprint: str = _name


class RunCreate(_Body):
    """``POST /v1/runs``: one shadow session. Idempotent on ``run_key``."""

    run_key: str = Field(min_length=1, max_length=200, description="client-chosen key; same key, same run")
    model: str = _name
    num_layers: int = Field(ge=1, le=100_000, strict=True)  # (strict: "4" and true are not layer counts)
    # the launch's ranks: TP size, times the replicas of a data-parallel launch (each rank runs every layer)
    tp_size: int = Field(1, ge=1, le=4096, strict=True)
    gpu_name: str = Field("", max_length=200)
    gpu_arch: str = Field("", max_length=50)
    driver: str = Field("", max_length=100)
    sglang_version: str = Field("", max_length=50)
    candidate: Impl
    baseline: Impl
    labels: dict[str, str] = Field(default_factory=dict, max_length=LABELS_MAX)
    started_at: float | None = Field(None, ge=0, le=TS_MAX, allow_inf_nan=False,
                                     description="unix seconds (before 2100); the server's clock when omitted")

    @field_validator("labels")
    @classmethod
    def _labels(cls, labels: dict[str, str]) -> dict[str, str]:
        for key, value in labels.items():
            if not 1 <= len(key) <= LABEL_KEY_MAX or "\x00" in key:
                raise ValueError(f"label key {key[:40]!r}: 1 to {LABEL_KEY_MAX} characters, without NUL characters")
            if len(value) > LABEL_VALUE_MAX or "\x00" in value:
                raise ValueError(f"label {key!r}: at most {LABEL_VALUE_MAX} characters, without NUL characters")
            # a lone surrogate (JSON's "\\udfff"): pydantic refuses it in a str field but not in a dict's keys and
            # values; stored, no answer that shows the run could be encoded again (500 on every read of the run list)
            if not _is_unicode(key) or not _is_unicode(value):
                raise ValueError(f"label {key[:40]!a}: not valid Unicode text (a lone surrogate)")
        return labels

    def fields(self) -> dict[str, Any]:
        return {
            "run_key": self.run_key, "model": self.model, "num_layers": self.num_layers,
            "tp_size": self.tp_size, "gpu_name": self.gpu_name, "gpu_arch": self.gpu_arch,
            "driver": self.driver, "sglang_version": self.sglang_version,
            "candidate_name": self.candidate.name, "candidate_fingerprint": self.candidate.fingerprint,
            "baseline_name": self.baseline.name, "baseline_fingerprint": self.baseline.fingerprint,
            "labels": self.labels, "started_at": self.started_at,
        }


class RunOut(BaseModel):
    id: int
    run_key: str
    model: str
    num_layers: int
    tp_size: int
    gpu_name: str
    gpu_arch: str
    driver: str
    sglang_version: str
    candidate: Impl
    baseline: Impl
    labels: dict[str, str]
    started_at: float
    mode_override: str | None
    samples: int
    batches: int
    duplicate_batches: int
    candidate_errors: int
    cand_nonfinite: int
    base_nonfinite: int
    exceeded_calls: int
    requests: int
    oracle_samples: int
    first_sample_ts: float | None
    last_sample_ts: float | None
    last_ingest_at: float | None
    speculative: dict[str, dict[str, float]] = Field(
        default_factory=dict, description="SGLang's accept length per hook mode (off / validate / on)")
    on_mode_shapes: dict[str, int] = Field(
        default_factory=dict, description="on mode's calls on a shape bucket the verdict covers (covered_calls) and "
        "on one it does not, served by the baseline (uncovered_calls), over the run's processes; {} before any")

    @classmethod
    def of(cls, row: dict[str, Any], speculative: dict[str, dict[str, float]] | None = None,
           on_mode_shapes: dict[str, int] | None = None) -> RunOut:
        return cls(
            id=row["id"], run_key=row["run_key"], model=row["model"], num_layers=row["num_layers"],
            tp_size=row["tp_size"], gpu_name=row["gpu_name"], gpu_arch=row["gpu_arch"], driver=row["driver"],
            sglang_version=row["sglang_version"],
            candidate=Impl(name=row["candidate_name"], fingerprint=row["candidate_fingerprint"]),
            baseline=Impl(name=row["baseline_name"], fingerprint=row["baseline_fingerprint"]),
            labels=row["labels"] or {}, started_at=row["started_at"], mode_override=row["mode_override"],
            samples=row["n_samples"], batches=row["n_batches"], duplicate_batches=row["n_duplicates"],
            candidate_errors=row["n_errors"], cand_nonfinite=row["n_cand_nonfinite"],
            base_nonfinite=row["n_base_nonfinite"], exceeded_calls=row["n_exceed"], requests=row["n_requests"],
            oracle_samples=row["n_oracle"], first_sample_ts=row["first_sample_ts"],
            last_sample_ts=row["last_sample_ts"], last_ingest_at=row["last_ingest_at"],
            speculative=speculative or {}, on_mode_shapes=on_mode_shapes or {},
        )


class ModeChange(BaseModel):
    """``PUT /v1/runs/{id}/mode``: the kill switch. ``null`` clears the override."""

    model_config = ConfigDict(extra="forbid")
    mode: Literal["validate", "off"] | None


class IngestAnswer(BaseModel):
    run_id: int
    accepted: int
    duplicate: bool
    mode_override: str | None
