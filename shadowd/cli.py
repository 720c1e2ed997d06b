"""The ``shadowd`` command line (typer)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Annotated

import typer

from shadowd import __version__

__all__ = ["app"]

app = typer.Typer(help="shadowd: shadow-mode numerical diff service for GPU kernels.", no_args_is_help=True,
                  add_completion=False)
db_app = typer.Typer(help="Database schema (Alembic migrations).", no_args_is_help=True)
app.add_typer(db_app, name="db")

DbOption = Annotated[str | None, typer.Option("--db", help="SQLAlchemy URL (default: SHADOWD_DB_URL or "
                                                        "sqlite:///shadowd.db)")]


def _db_url(db: str | None) -> str:
    from shadowd.collector.settings import CollectorSettings

    return db or CollectorSettings().db_url


@app.command()
def version() -> None:
    """Print the version."""
    typer.echo(__version__)


@app.command()
def serve(
    db: DbOption = None,
    host: Annotated[str | None, typer.Option(help="interface (default 127.0.0.1)")] = None,
    port: Annotated[int | None, typer.Option(help="port (default 8787)")] = None,
    token: Annotated[str | None, typer.Option(help="bearer token (or SHADOWD_TOKEN)")] = None,
    upgrade: Annotated[bool, typer.Option("--upgrade", help="apply pending migrations at start")] = False,
    policy: Annotated[Path | None, typer.Option(help="readiness policy file (TOML/JSON)")] = None,
    log_level: Annotated[str, typer.Option(help="log level")] = "info",
) -> None:
    """Run the collector (FastAPI on uvicorn)."""
    import uvicorn

    from shadowd.collector.app import create_app
    from shadowd.collector.db import SchemaOutdated
    from shadowd.collector.settings import CollectorSettings

    overrides: dict[str, object] = {}
    for key, value in (("db_url", db), ("host", host), ("port", port), ("token", token),
                       ("policy_file", policy)):
        if value is not None:
            overrides[key] = value
    if upgrade:
        overrides["auto_upgrade"] = True
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = CollectorSettings(**overrides)  # type: ignore[arg-type]
    try:
        application = create_app(settings)
    except SchemaOutdated as exc:
        typer.echo(f"shadowd: refusing to start: {exc}", err=True)
        raise typer.Exit(3) from None
    if not settings.token:
        typer.secho("WARNING: no token configured (SHADOWD_TOKEN): anyone who can reach this port can write "
                    "samples and flip the kill switch.", fg="yellow", err=True)
    uvicorn.run(application, host=settings.host, port=settings.port, log_level=log_level.lower())


@app.command()
def readiness(
    url: Annotated[str, typer.Option(help="collector base URL", envvar="SHADOWD_URL")] = "http://127.0.0.1:8787",
    run: Annotated[int | None, typer.Option("--run", help="run id (default: the latest run)")] = None,
    wait: Annotated[float, typer.Option(help="poll until READY or this many seconds pass")] = 0.0,
    token: Annotated[str | None, typer.Option(help="bearer token", envvar="SHADOWD_TOKEN")] = None,
) -> None:
    """Print the verdict and its reasons; a pipeline gate.

    Exit 0 READY, 1 NOT_READY, 2 INSUFFICIENT_DATA, 3 collector unreachable, 4 request refused
    (unknown run, bad token)."""
    from shadowd.readiness_cli import readiness_command

    raise typer.Exit(readiness_command(url, run, wait, token))


@app.command()
def selftest(
    quick: Annotated[bool, typer.Option("--quick", help="three cases instead of the full sweep")] = False,
    seed: Annotated[int, typer.Option(help="seed of the random part of the sweep")] = 7,
) -> None:
    """Check the candidate kernel on this GPU against the fp64 oracle over a shape sweep.

    Builds the kernel, compares it with the oracle (and SGLang's Triton kernel when installed), times
    both, and exits 0 only when every case passes."""
    from shadowd.selftest import selftest_main

    raise typer.Exit(selftest_main(quick=quick, seed=seed, echo=typer.echo))


@app.command()
def demo(
    fault: Annotated[str, typer.Option(help="plant a faulty candidate: none, nan, bias, drift or crash")] = "none",
    duration: Annotated[float, typer.Option(help="longest workload time in seconds")] = 60.0,
    layers: Annotated[int, typer.Option(help="layers of the simulated model")] = 8,
    db: DbOption = None,
    port: Annotated[int | None, typer.Option(help="collector port (default: a free one)")] = None,
    keep_serving: Annotated[bool, typer.Option("--keep-serving", help="leave the collector running")] = False,
) -> None:
    """Run the whole loop on the CPU: collector, hook, streamer, verdict.

    Starts a collector on SQLite, runs a simulated MLA tree-verify workload through the real hook and
    streamer, and prints the readiness verdict (judged with the shipped demo policy)."""
    from shadowd.demo import FAULTS, run_demo

    if fault not in FAULTS:
        typer.echo(f"--fault must be one of {', '.join(FAULTS)}, got {fault!r}", err=True)
        raise typer.Exit(2)
    raise typer.Exit(run_demo(fault=fault, db_url=db, port=port, duration=duration, num_layers=layers,
                              keep_serving=keep_serving))


@app.command()
def replay(bundle: Annotated[Path, typer.Argument(help="a repro bundle directory", exists=True)]) -> None:
    """Rerun baseline, candidate and oracle on a repro bundle's exact inputs and print the diffs."""
    from shadowd.hook.replay import format_report, replay_bundle

    typer.echo(format_report(replay_bundle(bundle)))


@db_app.command("upgrade")
def db_upgrade(db: DbOption = None, revision: str = "head") -> None:
    """Apply migrations (creates the schema on an empty database)."""
    from shadowd.collector.db import upgrade

    upgrade(_db_url(db), revision)
    typer.echo(f"database at {revision}")


@db_app.command("downgrade")
def db_downgrade(revision: Annotated[str, typer.Argument(help="target revision, or 'base'")],
                 db: DbOption = None) -> None:
    """Revert migrations down to REVISION."""
    from shadowd.collector.db import downgrade

    downgrade(_db_url(db), revision)
    typer.echo(f"database at {revision}")


@db_app.command("current")
def db_current(db: DbOption = None) -> None:
    """Print the database's schema revision and whether it is current."""
    from shadowd.collector.db import SchemaOutdated, check_schema, make_engine

    url = _db_url(db)
    try:
        check_schema(make_engine(url), url)
    except SchemaOutdated as exc:
        typer.echo(str(exc))
        raise typer.Exit(1) from None
    typer.echo("database schema is current")


def main() -> None:  # pragma: no cover - console entry
    sys.exit(app())
