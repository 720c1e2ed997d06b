#!/usr/bin/env bash
# Tools of the observability tests (tests/observability): promtool and the Prometheus server, Alertmanager
# with amtool, headless Chromium (Debian packages), and check-jsonschema + PyYAML into the active Python.
# Usage: .ci/install-observability.sh   (run with the project's virtualenv active, or set PYTHON)
set -euo pipefail

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

$SUDO apt-get update
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y \
  prometheus prometheus-alertmanager chromium

# The Debian packages start the services; the tests start their own on free loopback ports.
if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
  $SUDO systemctl disable --now prometheus prometheus-alertmanager prometheus-node-exporter 2>/dev/null || true
fi

"${PYTHON:-python}" -m pip install check-jsonschema pyyaml

for tool in promtool prometheus amtool chromium; do
  command -v "$tool" >/dev/null || { echo "missing after install: $tool" >&2; exit 1; }
done
command -v prometheus-alertmanager >/dev/null || command -v alertmanager >/dev/null \
  || { echo "missing after install: prometheus-alertmanager" >&2; exit 1; }
"${PYTHON:-python}" -m check_jsonschema --version >/dev/null
