"""The package's layout holds: the import rules of docs/contributing.md are kept (import-linter, as CI runs it),
and a rank, however it was started, has loaded nothing of the kernel side when its payload runs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import rankfns

import nbdist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_import_contracts_are_kept():
    """pyproject.toml's [tool.importlinter] contracts: layers flow down, no cycles, the rank side and
    the protocol import nothing of the kernel side, only the front ends import IPython."""
    lint = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    out = subprocess.run([lint, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout, out.stdout


@pytest.mark.usefixtures("start_method")
def test_a_rank_loads_nothing_of_the_kernel_side():
    """Spawned and warm ranks: the payload runs with no session, run, launcher, view or IPython module."""
    assert nbdist.launch(rankfns.kernel_side_modules, nprocs=2) == {0: [], 1: []}


def test_a_rank_under_an_engine_loads_nothing_of_the_kernel_side():
    """``python -m nbdist.worker RUN_DIR`` (what torchrun, mpirun and srun start)."""
    assert nbdist.launch(rankfns.kernel_side_modules, nprocs=2, launcher="torchrun") == {0: [], 1: []}


def test_import_nbdist_loads_nothing_until_a_name_is_used():
    code = ("import sys, nbdist\n"
            "before = sorted(m for m in sys.modules if m.startswith('nbdist'))\n"
            "nbdist.rank()\n"
            "after = sorted(m for m in sys.modules if m.startswith('nbdist'))\n"
            "print(before, after, 'psutil' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.stdout.strip() == "['nbdist'] ['nbdist', 'nbdist.protocol', 'nbdist.protocol.world'] False False", \
        out.stdout + out.stderr
