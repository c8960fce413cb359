#!/usr/bin/env bash
# Install Debian's Chromium for the dashboard's browser tests (tests/browser/) when it is missing.
# Playwright drives this system browser (executable /usr/bin/chromium); it never downloads one of its own.
set -euo pipefail

if [ -x /usr/bin/chromium ]; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install_browser: /usr/bin/chromium is missing and apt-get is not available; install Chromium by hand" >&2
  exit 1
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  SUDO="sudo"
fi
echo "install_browser: installing Debian's chromium" >&2
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
/usr/bin/chromium --version >&2
