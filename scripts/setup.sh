#!/usr/bin/env bash
# Make .venv with everything nbdist, its tests, its demos and its docs need. Safe to run again: it only
# installs when pyproject.toml changed since the last run. Sourced by demo.sh and test.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
stamp=.venv/.nbdist-installed
# Debian packages the tests drive for real: Chromium for the browser tests (never a browser that
# playwright downloads), Slurm with munge for the srun launcher and Slurm attach, iproute2 for the
# network-namespace test. MPI comes from pip (mpi4py + mpich, in the test extra).
apt_wanted=()
[ -x /usr/bin/chromium ] || apt_wanted+=(chromium)
command -v slurmctld >/dev/null 2>&1 || apt_wanted+=(slurm-wlm)
command -v ip >/dev/null 2>&1 || apt_wanted+=(iproute2)
if [ ${#apt_wanted[@]} -gt 0 ] && command -v apt-get >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${apt_wanted[@]}" >/dev/null
    else
        echo "note: ${apt_wanted[*]} missing (not root); the tests that need them will be skipped" >&2
    fi
fi
want=$(sha256sum pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    # torch first and pinned: this takes the local CPU wheel. Letting a dependency pull a bare
    # "torch" would download a CUDA build of several GB.
    .venv/bin/python -m pip install -q "torch==2.13.0" numpy
    .venv/bin/python -m pip install -q -e ".[test,browser,docs]"
    echo "$want" > "$stamp"
fi
