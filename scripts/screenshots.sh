#!/usr/bin/env bash
# The tour's screenshots: docs/tour/*.png, taken in a real JupyterLab in headless Chromium by the
# browser suite's harness (tests/lab_browser.py). Run it whenever the view changes, then commit the
# PNGs; `--only NAME ...` retakes some. Needs what the browser tests need (setup.sh installs it).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
exec .venv/bin/python scripts/screenshots.py "$@"
