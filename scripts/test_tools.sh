#!/usr/bin/env bash
# Debian packages the test suite drives when present: Chromium (the dashboard's browser tests, which fail
# without it), promtool (checks the shipped Prometheus rules) and docker-compose (validates the compose file).
# Installs whichever is missing; Chromium is required, the other two are best effort.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_browser.sh || exit 1
missing=()
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
command -v docker-compose >/dev/null 2>&1 || docker compose version >/dev/null 2>&1 || missing+=(docker-compose)
if [ ${#missing[@]} -gt 0 ] && command -v apt-get >/dev/null 2>&1; then
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  echo "test_tools: installing ${missing[*]}" >&2
  $SUDO apt-get update -qq >/dev/null 2>&1 || true
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
    || echo "test_tools: could not install ${missing[*]}; the tests that need them skip" >&2
fi
exit 0
