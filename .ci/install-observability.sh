#!/usr/bin/env bash
# System tools of the observability tests (tests/observability): the Prometheus server with promtool,
# Alertmanager with amtool, and headless Chromium — Debian packages. check-jsonschema and PyYAML come
# with the project's dev extra. Does nothing when every tool is already installed.
# Usage: .ci/install-observability.sh
set -euo pipefail

have_all() {
  for tool in promtool prometheus amtool chromium; do
    command -v "$tool" >/dev/null || return 1
  done
  command -v prometheus-alertmanager >/dev/null || command -v alertmanager >/dev/null
}

if have_all; then
  echo "observability tools already installed"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
$SUDO apt-get update
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y prometheus prometheus-alertmanager chromium

# The Debian packages start the services; the tests start their own on free loopback ports.
if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
  $SUDO systemctl disable --now prometheus prometheus-alertmanager prometheus-node-exporter 2>/dev/null || true
fi

have_all || { echo "observability tools still missing after the install" >&2; exit 1; }
