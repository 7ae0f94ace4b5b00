"""What every engine launcher shares: start the engine in a session of its own, follow the ranks
through the run dir, and hand the engine's session to the teardown.

An engine (mpiexec, torchrun, srun) starts the ranks; nbdist only builds its command and env.
The engine runs in a session of its own, so a stop reaches it and everything it started; it
dies with the kernel (PR_SET_PDEATHSIG, set between fork and exec); and every rank registers
its pid in the run dir, because the engine does not tell us. Ranks that srun starts are not
even our descendants: the teardown finds them by the run's marker.
"""

from __future__ import annotations

import abc
import contextlib
import functools
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field

from nbdist.launchers.base import Launcher
from nbdist.launchers.forker import is_forker_thread
from nbdist.launchers.processes import is_gone
from nbdist.protocol import registration, rundir
from nbdist.protocol.rundir import RUN_DIR_ENV, RUN_ID_ENV
from nbdist.protocol.signals import set_pdeathsig

__all__ = ["EngineLauncher", "python_path_for_ranks", "tail_engine_log"]

ENGINE_LOG = "launcher.log"


def python_path_for_ranks() -> str:
    """PYTHONPATH that lets the ranks import by name what the kernel imports by name."""
    paths = [p or os.getcwd() for p in sys.path] + [p for p in [os.environ.get("PYTHONPATH")] if p]
    return os.pathsep.join(dict.fromkeys(paths))


def tail_engine_log(run_dir: str, max_lines: int = 12) -> str:
    """The last lines the engine itself printed (its own errors, ranks that never started)."""
    try:
        with open(os.path.join(run_dir, ENGINE_LOG), errors="backslashreplace") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-max_lines:])


@dataclass
class EngineLauncher(Launcher):
    """Start ``nprocs`` ranks (of this node) through an engine, and follow them through the run dir.

    Subclasses say which command starts the engine; everything else is shared. Rank slots are
    0..nprocs-1 on this node; the ranks register under their global rank
    (``node_rank * nprocs + slot``).
    """

    launcher_args: list = field(default_factory=list)
    nnodes: int = 1
    node_rank: int = 0
    name: str = "engine"
    # The kernel hosts the TCPStore the ranks meet at (False where the engine brings its own).
    hosts_rendezvous: bool = True
    # Ranks may run on other machines: the kernel opens an output channel for them.
    remote_ranks: bool = True

    def __post_init__(self):
        self._engine: subprocess.Popen | None = None
        self._run_dir: str | None = None
        self._nprocs = 0
        self._where: dict[int, registration.RankPid] = {}  # slot -> pid and host, as each rank registered
        self._codes: dict[int, int | None] = {}

    # ---- what a subclass provides -------------------------------------------------------
    @abc.abstractmethod
    def command(self, run_dir: str, nprocs: int) -> list[str]:
        """The engine's command line, ending with ``python -m nbdist.worker RUN_DIR``."""

    def world_size_for(self, nprocs: int) -> int:
        """mpiexec and srun place ``nprocs`` ranks in all, over their nodes (torchrun starts
        ``nprocs`` per node, and says so)."""
        return nprocs

    def engine_env(self, nprocs: int) -> dict[str, str]:
        """Extra env for the engine and its ranks."""
        return {}

    # ---- shared -----------------------------------------------------------------------------
    def start(self, run_dir: str, run_id: str, nprocs: int, env: dict[str, str]) -> None:
        cmd = self.command(run_dir, nprocs)
        child_env = dict(os.environ, **self.engine_env(nprocs), **env, **{RUN_ID_ENV: run_id, RUN_DIR_ENV: run_dir})
        child_env.setdefault("OMP_NUM_THREADS", "1")
        child_env["PYTHONPATH"] = python_path_for_ranks()
        self._run_dir, self._nprocs = run_dir, nprocs
        self._codes = dict.fromkeys(range(nprocs))
        # PDEATHSIG follows the thread that forks: the forker thread (nbdist.launchers.forker) or the
        # main thread live as long as the kernel. SIGTERM, so that the engine takes down the ranks
        # it started before it goes (and they watch the kernel themselves too).
        die_with_parent = None
        if is_forker_thread() or threading.current_thread() is threading.main_thread():
            die_with_parent = functools.partial(set_pdeathsig, signal.SIGTERM)
        log = os.open(os.path.join(run_dir, ENGINE_LOG), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            self._engine = subprocess.Popen(cmd, env=child_env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                            start_new_session=True, preexec_fn=die_with_parent)
        finally:
            os.close(log)

    def _registered(self) -> dict[int, registration.RankPid]:
        """slot -> where each rank that registered so far runs (its pid and host)."""
        if self._run_dir and len(self._where) < self._nprocs:
            offset = self.node_rank * self._nprocs
            self._where = {r - offset: w for r, w in registration.read_rank_pids(self._run_dir).items()
                           if 0 <= r - offset < self._nprocs}
        return self._where

    @property
    def pids(self) -> dict[int, int]:
        """slot -> pid of the ranks that have registered so far (on whichever host)."""
        return {slot: where.pid for slot, where in self._registered().items()}

    def remote_slots(self) -> set[int]:
        """Slots whose rank runs on another machine: their pids are never looked up or signalled here."""
        return {slot for slot, where in self._registered().items() if not where.local}

    def poll(self) -> dict[int, int | None]:
        """slot -> exit code as far as the run dir tells it: 0 with a result, 1 with an error.

        A local rank has exited when its pid is gone; a rank on another machine, when it left its
        result or error (or when the engine ended): its pid is another machine's.
        """
        engine = None if self._engine is None else self._engine.poll()
        offset = self.node_rank * self._nprocs
        for slot, where in self._registered().items():
            if self._codes[slot] is not None:
                continue
            if where.local and is_gone(where.pid):
                self._codes[slot] = 0 if rundir.has_result(self._run_dir, offset + slot) else 1
            elif not where.local and rundir.has_result(self._run_dir, offset + slot):
                self._codes[slot] = 0
            elif not where.local and rundir.has_error(self._run_dir, offset + slot):
                self._codes[slot] = 1
        if engine is not None:  # the engine is gone: ranks that never reported died with it
            for slot in self._codes:
                if self._codes[slot] is None:
                    where = self._where.get(slot)
                    if where is None or not where.local or is_gone(where.pid):
                        self._codes[slot] = engine if engine != 0 else 1
        return dict(self._codes)

    def collect_exited(self, run_dir: str, known: set[int]) -> dict[int, int]:
        return {r: c for r, c in self.poll().items() if c is not None and r not in known}

    def leaders(self) -> list[int]:
        """The engine's session first (it holds every process it started), then live local ranks."""
        out = [self._engine.pid] if self._engine is not None and self._engine.poll() is None else []
        return out + [w.pid for w in self._registered().values() if w.local and not is_gone(w.pid)]

    def engine_log(self) -> str:
        return tail_engine_log(self._run_dir) if self._run_dir else ""

    def close(self) -> None:
        if self._engine is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._engine.wait(timeout=5)
