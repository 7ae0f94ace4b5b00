#!/usr/bin/env bash
# Build the documentation site into docs/_build/html, from nothing, with warnings as errors.
#
# Sphinx with pydata-sphinx-theme, myst-parser, myst-nb and numpydoc (the `docs` extra, which
# setup.sh installs). myst-nb executes notebooks/ on CPU ranks as it builds; its cache
# (docs/_build/.jupyter_cache) keeps their outputs until a notebook's code changes, and `--clean`
# empties it too. No link check and no remote intersphinx: the build needs no network.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
if [ "${1:-}" = "--clean" ]; then
    rm -rf docs/_build
fi
# The page tree is rebuilt every time (-E, no old doctrees): a stale one could hide a broken reference.
rm -rf docs/_build/html docs/_build/doctrees
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # several ranks on few cores: one thread each
export PATH="$PWD/.venv/bin:$PATH"  # the notebooks' engines (torchrun, mpiexec) come from the venv
start=$(date +%s)
.venv/bin/python -m sphinx -W --keep-going -E -b html -d docs/_build/doctrees docs docs/_build/html
echo "docs: built docs/_build/html in $(( $(date +%s) - start )) s"
