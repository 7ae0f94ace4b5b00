"""The srun launcher: ``srun -n N [-N nodes] [launcher_args] python -m nbdist.worker RUN_DIR``.

Slurm starts the ranks under its own slurmstepd, so they are not the kernel's descendants: they
carry the run's marker (srun passes the kernel's env on), and the teardown finds them by it.
Stopping srun itself cancels the step. Everything else is :class:`EngineLauncher`.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass

from nbdist.errors import LaunchConfigError
from nbdist.launchers.engine import EngineLauncher

__all__ = ["SrunLauncher", "find_srun"]


def find_srun() -> str:
    found = shutil.which("srun")
    if not found:
        raise LaunchConfigError(
            "launcher='srun' needs Slurm's srun, which is not on PATH here: run the kernel on a Slurm "
            "login or compute node (module load slurm), or apt-get install slurm-wlm"
        )
    return found


@dataclass
class SrunLauncher(EngineLauncher):
    """``nnodes`` becomes ``-N``; ``launcher_args`` go to srun (``["--partition", "gpu"]``)."""

    name: str = "srun"

    def spans_nodes(self) -> bool:
        # Inside a multi-node allocation srun spreads tasks over its nodes even without -N.
        return self.nnodes > 1 or int(os.environ.get("SLURM_JOB_NUM_NODES") or 1) > 1

    def command(self, run_dir: str, nprocs: int) -> list[str]:
        # nprocs here is the whole step: srun places the tasks on the nodes.
        cmd = [find_srun(), "-n", str(nprocs)]
        if self.nnodes > 1:
            cmd += ["-N", str(self.nnodes)]
        # --kill-on-bad-exit: one failing task ends the step, as fail-fast does for spawn.
        # --label: what a task prints before it reaches its log (an import error) says whose it is.
        cmd += ["--kill-on-bad-exit=1", "--export=ALL", "--label"]
        return cmd + [str(a) for a in self.launcher_args] + [sys.executable, "-m", "nbdist.worker", run_dir]
