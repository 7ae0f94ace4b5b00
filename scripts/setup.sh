#!/usr/bin/env bash
# Make .venv with everything nbdist, its tests and its demos need. Safe to run again: it only
# installs when pyproject.toml changed since the last run. Sourced by demo.sh and test.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
stamp=.venv/.nbdist-installed
# The browser tests drive Debian's Chromium (never a browser that playwright downloads).
if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
    else
        echo "note: /usr/bin/chromium is missing; the browser tests will be skipped (apt-get install chromium)" >&2
    fi
fi
want=$(sha256sum pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    # torch first and pinned: this takes the local CPU wheel. Letting a dependency pull a bare
    # "torch" would download a CUDA build of several GB.
    .venv/bin/python -m pip install -q "torch==2.13.0" numpy
    .venv/bin/python -m pip install -q -e ".[test,browser]"
    echo "$want" > "$stamp"
fi
