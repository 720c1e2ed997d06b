"""Collector settings: flags and ``SHADOWD_*`` environment variables (pydantic-settings)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["DB_SCHEMES", "DEFAULT_DB_URL", "CollectorSettings"]

DEFAULT_DB_URL = "sqlite:///shadowd.db"
#: the URL schemes the collector runs on (SQLAlchemy dialect + driver): SQLite, PostgreSQL through psycopg 3 (the
#: ``postgres`` extra) or psycopg2
DB_SCHEMES = ("sqlite", "sqlite+pysqlite", "postgresql", "postgresql+psycopg", "postgresql+psycopg2")


class CollectorSettings(BaseSettings):
    """Everything the collector reads at start.

    Each field is also read from the environment as ``SHADOWD_<FIELD>`` (for example
    ``SHADOWD_DB_URL``); ``shadowd serve`` flags override the environment.
    """

    model_config = SettingsConfigDict(env_prefix="SHADOWD_", extra="ignore")

    db_url: str = Field(DEFAULT_DB_URL, description="SQLAlchemy URL; a SQLite file by default")
    host: str = Field("127.0.0.1", description="interface to listen on")
    port: int = Field(8787, ge=0, le=65535, description="TCP port")
    token: str | None = Field(None, description="bearer token required on write and read APIs")
    max_body_bytes: int = Field(32 * 1024 * 1024, ge=1024, description="largest request body (413 above)")
    auto_upgrade: bool = Field(False, description="apply pending migrations at start instead of refusing")
    retention_hours: float = Field(
        168.0, ge=0, description="raw samples and stored evaluations older than this are deleted (rollups, each "
        "run's latest evaluation and its verdict changes kept); 0 keeps forever"
    )
    retention_interval_s: float = Field(300.0, gt=0, description="how often retention runs")
    time_bucket_s: int = Field(60, ge=1, description="width of the per-time rollup buckets")
    max_clock_skew_s: float = Field(
        300.0, ge=0, description="sample times further than this ahead of the collector's clock are refused (422)"
    )
    store_samples: bool = Field(True, description="keep raw samples (rollups are always kept)")
    policy_file: Path | None = Field(None, description="readiness policy (TOML/JSON); defaults otherwise")
    eval_interval_s: float = Field(15.0, gt=0, description="cadence of stored readiness evaluations")
    metrics_active_hours: float = Field(
        24.0, gt=0, description="runs with an ingest within this window are exported in /metrics"
    )
    ingest_writer: Literal["auto", "process", "inline"] = Field(
        "auto", description="where ingest's write transactions run: writer processes beside the HTTP process "
                            "(auto: for a SQLite file) or inline in the request threads (auto: PostgreSQL)"
    )
    ingest_writer_processes: int = Field(1, ge=1, le=16, description="writer processes (ingest_writer=process)")

    def writer_process(self) -> bool:
        """Whether ingest writes go to a writer process (see shadowd.collector.writer)."""
        if self.ingest_writer != "auto":
            return self.ingest_writer == "process"
        url = self.db_url
        return url.startswith("sqlite") and ":memory:" not in url and url.rstrip("/") not in ("sqlite:", "sqlite")

    @field_validator("db_url")
    @classmethod
    def _known_scheme(cls, v: str) -> str:
        if v.split("://", 1)[0] not in DB_SCHEMES:
            raise ValueError("db_url must be a sqlite:/// or postgresql+psycopg:// URL")
        return v
