"""The mpirun launcher: ``mpiexec -n N [launcher_args] python -m nbdist.worker RUN_DIR``.

MPI starts the ranks and gives each its rank and size; everything else is :class:`EngineLauncher`.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass

from nbdist.errors import LaunchConfigError
from nbdist.launchers.engine import EngineLauncher

__all__ = ["MpirunLauncher", "find_mpiexec"]


def find_mpiexec() -> str:
    """mpiexec on PATH or beside this Python (pip's mpich installs it in the venv's bin)."""
    for name in ("mpiexec", "mpirun"):
        for path in (os.path.dirname(sys.executable), None):
            found = shutil.which(name, path=path)
            if found:
                return found
    raise LaunchConfigError(
        "launcher='mpirun' needs mpiexec, which is not installed here: pip install 'nbdist[mpi]' "
        "(mpi4py + mpich), or load your cluster's MPI module"
    )


@dataclass
class MpirunLauncher(EngineLauncher):
    """``launcher_args`` go to mpiexec, e.g. ``["--hostfile", "hosts"]``."""

    name: str = "mpirun"

    def spans_nodes(self) -> bool:
        hosts = {"--hostfile", "-hostfile", "-f", "--machinefile", "-machinefile", "-hosts", "--host", "-host", "-H"}
        return any(str(a).split("=")[0] in hosts for a in self.launcher_args)

    def command(self, run_dir: str, nprocs: int) -> list[str]:
        cmd = [find_mpiexec(), "-n", str(nprocs)]
        return cmd + [str(a) for a in self.launcher_args] + [sys.executable, "-m", "nbdist.worker", run_dir]
