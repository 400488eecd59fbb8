#!/usr/bin/env bash
# The Debian packages this repository needs, installed when missing (root, or sudo):
#   libibverbs1  Mooncake's transfer engine links it, even without RDMA hardware
#   prometheus   tests/e2e/test_grafana_dashboard.py evaluates deploy/grafana's queries with it (tests only)
# Called by scripts/setup.sh and scripts/test.sh; about 10 s the first time on a machine, nothing after.
set -euo pipefail
missing=()
ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1' || missing+=(libibverbs1)
command -v prometheus >/dev/null 2>&1 || missing+=(prometheus)
[ ${#missing[@]} -eq 0 ] && exit 0
echo "[setup] installing Debian packages: ${missing[*]}"
SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
$SUDO apt-get update -qq
# No recommends: prometheus would pull node-exporter and friends; no service is started (tests run the binary).
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
