#!/usr/bin/env bash
# Debian's chromium and chromium-driver for the report's headless render test (tests/test_report.py),
# installed only where missing. The test gives Selenium both paths, so no browser is ever downloaded.
set -euo pipefail
if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null
fi
