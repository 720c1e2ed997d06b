#!/usr/bin/env bash
# Runs the whole test suite. Creates .venv with what the tests need if it is missing or stale.
# PostgreSQL tests use SHADOWD_TEST_PG_URL (default postgresql+psycopg://postgres@127.0.0.1:5432/postgres).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
stamp=.venv/.shadowd-deps
want=$(cat pyproject.toml scripts/test.sh scripts/install-sglang-cpu.sh | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  # CPU torch for the hook and kernel tests (the collector itself never needs it)
  .venv/bin/python -m pip install -q "torch==2.13.0"
  .venv/bin/python -m pip install -q -e ".[dev,postgres]"
  # the real sglang package (no deps) for the plugin tests; torch stays the CPU build
  bash scripts/install-sglang-cpu.sh .venv/bin/python
  echo "$want" > "$stamp"
fi
if [ $# -eq 0 ]; then  # the whole suite (CI): the lint and type checks pyproject.toml configures, too
  .venv/bin/ruff check .
  .venv/bin/mypy shadowd
fi
exec .venv/bin/python -m pytest -q "$@"
