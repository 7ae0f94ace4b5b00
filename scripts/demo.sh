#!/usr/bin/env bash
# The main job: set up, then run the quickstart demo (DDP on 4 CPU ranks).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
exec .venv/bin/python examples/ddp_quickstart.py "$@"
