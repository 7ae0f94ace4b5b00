"""The mpirun launcher: ``mpiexec -n N [--hostfile F] python -m nbdist.worker RUN_DIR``.

MPI starts the ranks; nbdist only builds the command and the env. The engine runs in a session of
its own (so a stop reaches the engine and everything it started), dies with the kernel
(PR_SET_PDEATHSIG, set between fork and exec), and every rank finds its rank and size in the env
MPI gives it and registers its pid in the run dir.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field

from .. import payload
from ..errors import LaunchConfigError
from ..payload import RUN_DIR_ENV, RUN_ID_ENV
from ..proctree import is_gone
from ..worker import _set_pdeathsig

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
class MpirunLauncher:
    """Start ``nprocs`` ranks through the MPI engine, and follow them through the run dir."""

    launcher_args: list = field(default_factory=list)  # e.g. ["--hostfile", "hosts"]
    name: str = "mpirun"

    def __post_init__(self):
        self._engine: subprocess.Popen | None = None
        self._run_dir: str | None = None
        self._nprocs = 0
        self._pids: dict[int, int] = {}
        self._codes: dict[int, int | None] = {}

    def command(self, run_dir: str, nprocs: int) -> list[str]:
        cmd = [find_mpiexec(), "-n", str(nprocs)]
        return cmd + [str(a) for a in self.launcher_args] + [sys.executable, "-m", "nbdist.worker", run_dir]

    def start(self, run_dir: str, run_id: str, nprocs: int, env: dict[str, str]) -> None:
        cmd = self.command(run_dir, nprocs)
        child_env = dict(os.environ, **env, **{RUN_ID_ENV: run_id, RUN_DIR_ENV: run_dir})
        child_env.setdefault("OMP_NUM_THREADS", "1")
        # Ranks import by name what the kernel imports by name (spawn passes sys.path the same way).
        paths = [p or os.getcwd() for p in sys.path] + [p for p in [os.environ.get("PYTHONPATH")] if p]
        child_env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        self._run_dir, self._nprocs = run_dir, nprocs
        self._codes = dict.fromkeys(range(nprocs))
        # PDEATHSIG follows the thread that forks: only the main thread lives as long as the kernel.
        # SIGTERM, so that the engine takes down the ranks it started before it goes.
        die_with_parent = None
        if threading.current_thread() is threading.main_thread():
            die_with_parent = functools.partial(_set_pdeathsig, signal.SIGTERM)
        log = os.open(os.path.join(run_dir, "launcher.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            self._engine = subprocess.Popen(cmd, env=child_env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                            start_new_session=True, preexec_fn=die_with_parent)
        finally:
            os.close(log)

    @property
    def pids(self) -> dict[int, int]:
        if self._run_dir and len(self._pids) < self._nprocs:
            self._pids = {r: p for r, p in payload.read_pids(self._run_dir).items() if r < self._nprocs}
        return dict(self._pids)

    def sentinels(self) -> list[int]:
        return []

    def _engine_code(self) -> int | None:
        return None if self._engine is None else self._engine.poll()

    def poll(self) -> dict[int, int | None]:
        """rank -> exit code as far as the run dir tells it: 0 with a result, 1 with an error."""
        engine = self._engine_code()
        for rank, pid in self.pids.items():
            if self._codes[rank] is None and is_gone(pid):
                ok, _ = payload.read_result(self._run_dir, rank)
                self._codes[rank] = 0 if ok else 1
        if engine is not None:  # the engine is gone: ranks that never reported died with it
            for rank in self._codes:
                if self._codes[rank] is None:
                    pid = self._pids.get(rank)
                    if pid is None or is_gone(pid):
                        self._codes[rank] = engine if engine != 0 else 1
        return dict(self._codes)

    def collect_exited(self, run_dir: str, known: set[int]) -> dict[int, int]:
        return {r: c for r, c in self.poll().items() if c is not None and r not in known}

    def leaders(self) -> list[int]:
        """The engine's session first (it holds every process it started), then live ranks."""
        out = [self._engine.pid] if self._engine is not None and self._engine.poll() is None else []
        return out + [pid for pid in self.pids.values() if not is_gone(pid)]

    def close(self) -> None:
        if self._engine is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._engine.wait(timeout=5)
