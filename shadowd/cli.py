"""The ``shadowd`` command line (typer)."""

from __future__ import annotations

import logging
import socket
from pathlib import Path
from typing import Annotated

import typer

from shadowd import __version__

__all__ = ["EXIT_USAGE", "app", "main"]

#: a bad command line or configuration (an unknown option, a value of the wrong type, a database URL that cannot
#: be used, a missing file), for every command: sysexits' EX_USAGE, so that it never reads as one of
#: ``shadowd readiness``' verdict codes 0-4 (click's own usage status, 2, is INSUFFICIENT_DATA there)
EXIT_USAGE = 64

app = typer.Typer(help="shadowd: shadow-mode numerical diff service for GPU kernels.", no_args_is_help=True,
                  add_completion=False)
db_app = typer.Typer(help="Database schema (Alembic migrations).", no_args_is_help=True)
app.add_typer(db_app, name="db")

DbOption = Annotated[str | None, typer.Option("--db", help="SQLAlchemy URL (default: SHADOWD_DB_URL or "
                                                        "sqlite:///shadowd.db)")]


def _db_url(db: str | None) -> str:
    from shadowd.collector.settings import CollectorSettings

    # (--db goes through the settings' check too: a URL of another database is one line, not a traceback)
    return CollectorSettings(db_url=db).db_url if db else CollectorSettings().db_url


@app.command()
def version() -> None:
    """Print the version."""
    typer.echo(__version__)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(__version__)
        raise typer.Exit(0)


@app.callback()
def _options(
    show_version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                               help="print the version and exit")] = False,
) -> None:
    """shadowd: shadow-mode numerical diff service for GPU kernels."""


@app.command()
def serve(
    db: DbOption = None,
    host: Annotated[str | None, typer.Option(help="interface (default 127.0.0.1)")] = None,
    port: Annotated[int | None, typer.Option(help="port (default 8787)")] = None,
    token: Annotated[str | None, typer.Option(help="bearer token (or SHADOWD_TOKEN)")] = None,
    upgrade: Annotated[bool, typer.Option("--upgrade", help="apply pending migrations at start")] = False,
    policy: Annotated[Path | None, typer.Option(help="readiness policy file (TOML/JSON)")] = None,
    log_level: Annotated[str, typer.Option(help="critical, error, warning, info, debug or trace")] = "info",
) -> None:
    """Run the collector (FastAPI on uvicorn)."""
    import uvicorn

    from shadowd.collector.app import create_app
    from shadowd.collector.db import SchemaOutdated
    from shadowd.collector.settings import CollectorSettings

    level = log_level.lower()
    if level not in _LOG_LEVELS:
        raise typer.BadParameter(f"{log_level!r} is not one of {', '.join(_LOG_LEVELS)}", param_hint="'--log-level'")
    overrides: dict[str, object] = {}
    for key, value in (("db_url", db), ("host", host), ("port", port), ("token", token),
                       ("policy_file", policy)):
        if value is not None:
            overrides[key] = value
    if upgrade:
        overrides["auto_upgrade"] = True
    logging.basicConfig(level=_LOG_LEVELS[level], format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = CollectorSettings(**overrides)  # type: ignore[arg-type]
    # the address first: one in use (another collector, a demo) is refused before migrations and the writer
    # process start, naming the setting (uvicorn would say so only after both, and exit 3, the code for an
    # outdated schema); the probe is closed at once, uvicorn binds its own
    listen_socket(settings.host, settings.port).close()
    try:
        application = create_app(settings)
    except SchemaOutdated as exc:
        typer.echo(f"shadowd: refusing to start: {exc}", err=True)
        raise typer.Exit(3) from None
    uvicorn.run(application, host=settings.host, port=settings.port, log_level=level)


#: ``--log-level`` values: uvicorn's, with the number each stands for (uvicorn's ``trace`` is 5)
_LOG_LEVELS = {"critical": logging.CRITICAL, "error": logging.ERROR, "warning": logging.WARNING,
               "info": logging.INFO, "debug": logging.DEBUG, "trace": 5}


class PortInUse(Exception):
    """The collector's address cannot be listened on (in use, or a host this machine does not have)."""


def listen_socket(host: str, port: int, *,
                  hint: str = "--port / SHADOWD_PORT (or --host / SHADOWD_HOST)") -> socket.socket:
    """A TCP socket bound to ``host:port`` as uvicorn binds one; :class:`PortInUse` naming ``hint`` otherwise."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family=family)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        why = exc.strerror or str(exc)
        raise PortInUse(f"cannot listen on {host}:{port}: {why} — choose another {hint}") from None
    return sock


@app.command()
def readiness(
    url: Annotated[str, typer.Option(help="collector base URL", envvar="SHADOWD_URL")] = "http://127.0.0.1:8787",
    run: Annotated[int | None, typer.Option("--run", min=1, help="run id (default: the latest run)")] = None,
    wait: Annotated[float, typer.Option(min=0.0, help="poll until READY or this many seconds pass")] = 0.0,
    token: Annotated[str | None, typer.Option(help="bearer token", envvar="SHADOWD_TOKEN")] = None,
    expect_fingerprint: Annotated[str | None, typer.Option(
        "--expect-fingerprint", help="the candidate build the gate is for: another fingerprint exits 1")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the last answer as JSON (same exit codes)")] = False,
) -> None:
    """Print the verdict and its reasons; a pipeline gate.

    Exit 0 READY, 1 NOT_READY (or not the expected candidate), 2 INSUFFICIENT_DATA, 3 collector unreachable,
    4 request refused (unknown run, bad token). --wait stops early on a NOT_READY that holds for the run."""
    from shadowd.readiness_cli import readiness_command

    _check_seconds(wait, "'--wait'")
    _check_url(url)
    raise typer.Exit(readiness_command(url, run, wait, token, expect_fingerprint=expect_fingerprint,
                                       as_json=as_json))


@app.command()
def mode(
    run: Annotated[int, typer.Argument(min=1, help="the run id (the journal's 'run N (<key>), rank r streaming' "
                                                   "line; for an on-mode deployment, its own run)")],
    to: Annotated[str | None, typer.Argument(metavar="[validate|off|clear]",
                                             help="lower every producer of the run to this mode, or clear the "
                                                  "override; omit to print it")] = None,
    url: Annotated[str, typer.Option(help="collector base URL", envvar="SHADOWD_URL")] = "http://127.0.0.1:8787",
    token: Annotated[str | None, typer.Option(help="bearer token", envvar="SHADOWD_TOKEN")] = None,
) -> None:
    """Print or set a run's kill switch (rollback without a restart).

    'validate' serves SGLang's kernel again on every rank and keeps comparing; 'off' stops the candidate; 'clear'
    returns each rank to its own SHADOWD_MODE. Ranks act on it from their next exchange with the collector (about
    2 s), graph replays included. Exit 0 done, 3 collector unreachable, 4 refused (unknown run, bad token)."""
    from shadowd.mode_cli import CHOICES, mode_command

    if to is not None and to not in CHOICES:
        why = " (the kill switch only lowers a mode: on is set by SHADOWD_MODE)" if to == "on" else ""
        raise typer.BadParameter(f"{to!r} is not one of {', '.join(CHOICES)}{why}", param_hint="'MODE'")
    _check_url(url)
    raise typer.Exit(mode_command(url, run, to, token, echo=typer.echo))


def _check_seconds(value: float, hint: str) -> None:
    """A finite number of seconds, else a usage error naming the option (click's range check lets NaN and inf
    through)."""
    if value != value or value == float("inf"):
        raise typer.BadParameter(f"{value} is not a number of seconds", param_hint=hint)


def _check_url(url: str) -> None:
    """A collector URL httpx can send to (http or https, with a host): else a usage error naming --url."""
    from shadowd.client import url_problem

    if (why := url_problem(url)) is not None:
        raise typer.BadParameter(f"{url!r}: {why}", param_hint="'--url' / SHADOWD_URL")


@app.command()
def selftest(
    quick: Annotated[bool, typer.Option("--quick", help="three cases instead of the full sweep")] = False,
    seed: Annotated[int, typer.Option(help="seed of the random part of the sweep")] = 7,
    sanitize: Annotated[bool, typer.Option(
        "--sanitize", help="also run compute-sanitizer (memcheck, racecheck, initcheck, synccheck) over the "
                           "kernel's launches on this GPU")] = False,
    sanitize_timeout: Annotated[float, typer.Option(min=1.0, help="time limit of each compute-sanitizer tool, "
                                                                  "seconds")] = 900.0,
) -> None:
    """Check the candidate kernel on this GPU against the fp64 oracle over a shape sweep.

    Builds the kernel, compares it with the oracle (and SGLang's Triton kernel when installed), times
    both, and exits 0 only when every case passes. --sanitize: and only when compute-sanitizer's four tools
    find nothing in the kernel's machine code for this GPU."""
    from shadowd.selftest import selftest_main

    _check_seconds(sanitize_timeout, "'--sanitize-timeout'")
    raise typer.Exit(selftest_main(quick=quick, seed=seed, echo=typer.echo, sanitize=sanitize,
                                   sanitize_timeout_s=sanitize_timeout))


@app.command()
def demo(
    fault: Annotated[str, typer.Option(help="plant a faulty candidate: none, nan, bias, drift or crash")] = "none",
    duration: Annotated[float, typer.Option(min=1.0, help="longest workload time in seconds (it stops earlier "
                                                          "once the verdict is definitive)")] = 90.0,
    layers: Annotated[int, typer.Option(min=1, help="layers of the simulated model")] = 8,
    db: Annotated[str | None, typer.Option("--db", help="SQLAlchemy URL of the demo's collector (default: a "
                                                        "SQLite file in a new temporary directory)")] = None,
    port: Annotated[int | None, typer.Option(min=0, max=65535, help="collector port (default: a free one)")] = None,
    keep_serving: Annotated[bool, typer.Option("--keep-serving", help="leave the collector running")] = False,
) -> None:
    """Run the whole loop on the CPU: collector, hook, streamer, verdict.

    Starts a collector on SQLite, runs a simulated MLA tree-verify workload through the real hook and
    streamer, and prints the readiness verdict (judged with the shipped demo policy) and the `shadowd replay`
    command for a repro bundle of a breaching call, when there is one."""
    from shadowd.demo import FAULTS, run_demo

    if fault not in FAULTS:
        typer.echo(f"--fault must be one of {', '.join(FAULTS)}, got {fault!r}", err=True)
        raise typer.Exit(EXIT_USAGE)
    raise typer.Exit(run_demo(fault=fault, db_url=db, port=port, duration=duration, num_layers=layers,
                              keep_serving=keep_serving))


@app.command()
def replay(
    bundle: Annotated[Path, typer.Argument(help="a repro bundle directory", exists=True)],
    baseline: Annotated[str | None, typer.Option(help="module:function to rerun as the baseline (default: the "
                                                      "bundle's refs)")] = None,
    candidate: Annotated[str | None, typer.Option(help="module:function to rerun as the candidate")] = None,
    oracle: Annotated[str | None, typer.Option(help="module:function to rerun as the oracle")] = None,
) -> None:
    """Rerun baseline, candidate and oracle on a repro bundle's exact inputs and print the diffs.

    Exit 0 when both baseline and candidate were rerun, 1 when either could not be (not named, not importable,
    or it raised), 64 for a directory that is no bundle."""
    from shadowd.hook.replay import format_report, replay_bundle, resolve

    try:
        base_fn, cand_fn, oracle_fn = resolve(baseline), resolve(candidate), resolve(oracle)
    except (ImportError, AttributeError, ValueError) as exc:
        typer.echo(f"shadowd replay: cannot import a --baseline / --candidate / --oracle: {exc}", err=True)
        raise typer.Exit(EXIT_USAGE) from None
    try:
        result = replay_bundle(bundle, base_fn, cand_fn, oracle_fn)
    except ValueError as exc:
        typer.echo(f"shadowd replay: {exc}", err=True)
        raise typer.Exit(EXIT_USAGE) from None
    typer.echo(format_report(result))
    failed = result["missing"] or {"baseline", "candidate"} & set(result["errors"])
    raise typer.Exit(1 if failed else 0)


@db_app.command("upgrade")
def db_upgrade(db: DbOption = None,
               revision: Annotated[str, typer.Option(help="target revision (default: the latest)")] = "head") -> None:
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
    missing = _missing_sqlite_file(url)
    if missing is not None:  # (connecting would create an empty file there)
        typer.echo(f"no database file at {missing}: run `shadowd db upgrade --db {url}` to create it")
        raise typer.Exit(1)
    try:
        revision = check_schema(make_engine(url), url)
    except SchemaOutdated as exc:
        typer.echo(str(exc))
        raise typer.Exit(1) from None
    typer.echo(f"database schema is current (revision {revision})")


def _missing_sqlite_file(url: str) -> str | None:
    """The path of a SQLite URL's file when it does not exist (None for other URLs, in-memory ones, or a file)."""
    from sqlalchemy.engine import make_url

    u = make_url(url)
    if u.get_backend_name() != "sqlite" or u.database in (None, "", ":memory:") or Path(u.database).exists():
        return None
    return u.database


def main(argv: list[str] | None = None) -> int:
    """The ``shadowd`` console entry: the typer app, except that a bad command line exits EXIT_USAGE, and the
    configuration errors users make (see :func:`_config_error`) print one line naming what to fix instead of a
    traceback, and exit EXIT_USAGE too."""
    # click's UsageError as typer raises it (typer vendors click in recent releases): found from the public
    # BadParameter's bases, so that no private module is named
    usage_error: type[Exception] = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")
    try:
        rv = app(argv, standalone_mode=False)
    except usage_error as exc:
        # (no command at all: the help, and EXIT_USAGE as well — click's 2 would read as INSUFFICIENT_DATA to a
        # script that runs ``shadowd $CMD`` with an empty CMD)
        exc.show()  # type: ignore[attr-defined]
        return EXIT_USAGE
    except typer.Abort:
        typer.echo("Aborted!", err=True)
        return 1
    except Exception as exc:
        message = _config_error(exc)
        if message is None:
            raise
        typer.echo(f"shadowd: {message}", err=True)
        return EXIT_USAGE
    return rv if isinstance(rv, int) else 0


def _config_error(exc: BaseException) -> str | None:
    """One line for an error that bad configuration causes (a settings value, a database URL or file, a
    missing file, a migration revision, PostgreSQL without its driver); None for anything else (a bug: its
    traceback stays). Classified by the exception's module, so the command line imports neither pydantic nor
    SQLAlchemy nor Alembic to do it."""
    kind = type(exc).__module__.split(".")[0]
    if isinstance(exc, ModuleNotFoundError) and exc.name in ("psycopg", "psycopg2"):
        return "a PostgreSQL URL needs its driver: pip install 'shadowd[postgres]'"
    if isinstance(exc, FileNotFoundError):
        return f"no such file: {exc.filename or exc}"
    if kind in ("pydantic", "pydantic_core") and hasattr(exc, "errors"):
        parts = []
        for err in exc.errors():
            field = ".".join(str(x) for x in err.get("loc", ())) or "value"
            parts.append(f"{_SETTING_NAMES.get(field, field)}: {err.get('msg', '')}")
        return "invalid setting: " + "; ".join(parts)
    if kind == "sqlalchemy":
        detail = str(getattr(exc, "orig", None) or exc).splitlines()[0]
        hint = " (does its directory exist?)" if "unable to open database file" in detail else ""
        return f"cannot use the database: {detail}{hint} — check --db / SHADOWD_DB_URL"
    if kind == "alembic":
        return f"migrations: {str(exc).splitlines()[0]}"
    if isinstance(exc, PortInUse):
        return str(exc)
    if type(exc).__name__ == "PolicyError":  # shadowd.judge.policy: names the file and the knob
        return str(exc)
    return None


#: the settings' field names as a user sets them
_SETTING_NAMES = {"db_url": "--db / SHADOWD_DB_URL", "port": "--port / SHADOWD_PORT", "host": "--host / SHADOWD_HOST",
                  "token": "--token / SHADOWD_TOKEN", "policy_file": "--policy / SHADOWD_POLICY_FILE"}
