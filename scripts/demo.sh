#!/usr/bin/env bash
# The main job: set up, then execute the quickstart notebook headless (DDP on 4 CPU ranks).
# The executed notebook, with its widget state, is saved to .artifacts/01_quickstart.ipynb.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
mkdir -p .artifacts
exec .venv/bin/python -m nbdist.frontend.notebook_runner notebooks/01_quickstart.ipynb .artifacts/01_quickstart.ipynb "$@"
