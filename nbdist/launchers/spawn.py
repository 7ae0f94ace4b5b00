"""The spawn launcher: ranks this kernel makes itself, by one of three start methods.

* "spawn": a fresh interpreter per rank (``multiprocessing``'s spawn, nbdist's entry point first);
* "fork": the same, forking the kernel (refused once CUDA is initialised here);
* "warm": forked from this kernel's warm template (:mod:`nbdist.warmstart.handle`), which imported torch
  already; it reaps the ranks and sends their exit codes over the run's connection.

Spawned and forked ranks are the kernel's children: it reaps them and knows their exit codes.
Every rank then leaves for its own session (:func:`nbdist.worker.bootstrap.prepare_rank_process`), which
is what makes its children killable with it. The rest of the engine does not care how a rank
was made.
"""

from __future__ import annotations

import contextlib
import os
import signal
from dataclasses import dataclass

from nbdist.errors import LaunchConfigError
from nbdist.launchers.base import Launcher
from nbdist.launchers.processes import is_gone
from nbdist.launchers.spawn_hooks import starting_ranks
from nbdist.protocol.registration import read_pids
from nbdist.protocol.rundir import RUN_DIR_ENV, RUN_ID_ENV

__all__ = ["SpawnLauncher", "check_start_method", "START_METHODS"]

START_METHODS = ("warm", "spawn", "fork")


def check_start_method(start_method: str) -> None:
    """Refuse what can't work, before any process starts: above all, fork after CUDA."""
    if start_method not in START_METHODS:  # None/"auto" are resolved before this (nbdist.warm)
        raise LaunchConfigError(f"start_method must be one of {START_METHODS}, got {start_method!r}")
    if start_method == "fork":
        import sys

        from nbdist.launchers.cuda_watch import who_initialised_cuda
        from nbdist.worker.cuda_driver import cuda_driver_initialised

        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            who = who_initialised_cuda()
            by = f"first by {who}" if who else "before nbdist was loaded, so nbdist can't say where"
        elif cuda_driver_initialised():
            by = ("its driver initialised by torch.cuda.is_available() or another library; "
                  "PYTORCH_NVML_BASED_CUDA_CHECK=1 makes that check fork-safe")
        else:
            by = None
        if by is not None:
            raise LaunchConfigError(
                f"CUDA is already initialised in this kernel ({by}), so forked ranks can't use it "
                "('Cannot re-initialize CUDA in forked subprocess'); use start_method='warm' or 'spawn' (the default), "
                "or restart the kernel and launch before touching CUDA"
            )


def _exited_unreaped(pid: int) -> bool:
    """True when ``pid`` (our child) has exited, without reaping it: its pid, and so its process
    group id, stays reserved while we clean up after it."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True
    return info is not None


def _run_forked_rank(env: dict[str, str], rank: int, run_dir: str) -> None:
    """A rank forked from the kernel ("fork"): the run's variables are set in the child, after the
    fork, so the kernel's own environ never holds them."""
    from nbdist.worker.bootstrap import run_spawned_rank

    os.environ.update(env)
    run_spawned_rank(rank, run_dir)


class _ForkedRanks:
    """Ranks the warm template forked: their exit codes arrive over the run's connection."""

    def __init__(self, pids: dict[int, int], conn):
        self.pids = pids
        self.conn = conn
        self.codes: dict[int, int | None] = dict.fromkeys(pids)

    def poll(self) -> dict[int, int | None]:
        try:
            while self.conn is not None and self.conn.poll(0):
                _, local, code = self.conn.recv()
                self.codes[local] = code
        except (EOFError, OSError):  # all told (the template closes it after the last) or it died
            self.conn.close()
            self.conn = None
        if self.conn is None:
            # A template that died took its ranks along (their PDEATHSIG): they were killed.
            for rank, pid in self.pids.items():
                if self.codes[rank] is None and is_gone(pid):
                    self.codes[rank] = -signal.SIGKILL
        return dict(self.codes)

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


@dataclass
class SpawnLauncher(Launcher):
    """Start ``nprocs`` ranks of this kernel and keep their handles.

    ``start_method`` None means the default (:func:`nbdist.warmstart.handle.choose_start_method`): "warm"
    when the template is ready, else "spawn". It is resolved when the launcher is made.
    """

    start_method: str | None = None
    name: str = "spawn"
    # One spawning kernel per node of a bigger world (attach with --nprocs): this kernel's ranks
    # are node_rank * nprocs + local rank.
    nnodes: int = 1
    node_rank: int = 0
    hosts_rendezvous = True  # the ranks meet at the kernel's store (or the one kernel 0 hosts)
    remote_ranks = False  # every rank is a child of this kernel, here

    def __post_init__(self):
        from nbdist.warmstart.handle import choose_start_method

        self._explicit_warm = (self.start_method or os.environ.get("NBDIST_START_METHOD")) == "warm"
        self.start_method = choose_start_method(self.start_method)
        check_start_method(self.start_method)
        # rank -> what tells its exit: its multiprocessing.Process, or the template's _ForkedRanks. A
        # healed session's replacement rank gets a handle of its own; the dead one's is dropped.
        self._owner: dict[int, object] = {}
        self._pids: dict[int, int] = {}
        self._codes: dict[int, int | None] = {}

    def start(self, run_dir: str, run_id: str, nprocs: int, env: dict[str, str]) -> None:
        self._start_ranks(run_dir, run_id, list(range(nprocs)), env)

    def start_replacement(self, rank: int, run_dir: str, run_id: str, env: dict[str, str]) -> int:
        """Start rank ``rank`` again (a session's heal), as the first one was started: forked from the
        template where it serves, else spawned; the same marker, run dir and environment, plus
        ``env``. The dead one's handle is dropped. Returns the new pid. Call it on the forker thread."""
        if self._codes.get(rank) is None:
            raise RuntimeError(f"rank {rank} still runs: only a rank that ended is replaced")
        self._start_ranks(run_dir, run_id, [rank], env)
        return self._pids[rank]

    def _start_ranks(self, run_dir: str, run_id: str, ranks: list[int], env: dict[str, str]) -> None:
        import multiprocessing
        import multiprocessing.resource_tracker as resource_tracker

        from nbdist.protocol.signals import dump_signal_held
        from nbdist.worker.bootstrap import run_spawned_rank

        # The kernel's resource tracker starts lazily with the first child; start it outside the
        # marked window, or it would carry this run's marker and be stopped with the run.
        resource_tracker.ensure_running()
        child_env = {RUN_ID_ENV: run_id, RUN_DIR_ENV: run_dir, **env}
        # torchrun's default: N ranks on a shared CPU fight over threads otherwise.
        if "OMP_NUM_THREADS" not in os.environ and "OMP_NUM_THREADS" not in env:
            child_env["OMP_NUM_THREADS"] = "1"
        if self.start_method == "warm" and self._start_warm(run_dir, run_id, ranks, child_env):
            return
        # Plain multiprocessing, not torch.multiprocessing.start_processes: its entry point imports
        # torch before ours runs, so a rank would spend its first seconds without nbdist's stack-dump
        # handler, its log or its process group. Ours imports only nbdist.worker (stdlib) first.
        context = multiprocessing.get_context(self.start_method)
        if self.start_method == "fork":
            processes = {rank: context.Process(target=_run_forked_rank, args=(child_env, rank, run_dir), daemon=False,
                                               name=f"nbdist-rank-{rank}") for rank in ranks}
        else:
            processes = {rank: context.Process(target=run_spawned_rank, args=(rank, run_dir), daemon=False,
                                               name=f"nbdist-rank-{rank}") for rank in ranks}
        # Each child's environment is built here and handed to its exec: the kernel's os.environ is
        # never changed, not even while the ranks start (a subprocess the notebook starts meanwhile
        # would carry the run marker, and %dist_stop would kill it).
        with starting_ranks({**os.environ, **child_env}), dump_signal_held():
            for p in processes.values():
                p.start()
        for rank, p in processes.items():
            self._owner[rank], self._pids[rank], self._codes[rank] = p, p.pid, None

    def _start_warm(self, run_dir: str, run_id: str, ranks: list[int], child_env: dict) -> bool:
        """Fork the ranks from the template; False (said once) when it can't, and then we spawn."""
        import sys

        from nbdist.warmstart.handle import WarmUnavailable, fork_ranks, tell_once

        # spawn's semantics: the kernel's env, sys.path, cwd and argv as they are now, at launch.
        request = {"run_id": run_id, "run_dir": run_dir, "ranks": list(ranks),
                   "env": {**os.environ, **child_env}, "cwd": os.getcwd(), "sys_path": list(sys.path),
                   "argv": list(sys.argv)}
        try:
            pids, conn = fork_ranks(request, explicit=self._explicit_warm)
        except WarmUnavailable as exc:
            tell_once(f"{exc}; starting the ranks with spawn")
            self.start_method = "spawn"
            return False
        forked = _ForkedRanks({int(r): p for r, p in pids.items()}, conn)
        for rank, pid in forked.pids.items():
            self._owner[rank], self._pids[rank], self._codes[rank] = forked, pid, None
        return True

    @property
    def pids(self) -> dict[int, int]:
        """rank -> pid; kept after the handles are closed."""
        return dict(self._pids)

    def _forked_owners(self) -> list:
        return list({id(o): o for o in self._owner.values() if isinstance(o, _ForkedRanks)}.values())

    def sentinels(self) -> list:
        out = [f.conn for f in self._forked_owners() if f.conn is not None]
        return out + [o.sentinel for r, o in self._owner.items() if not isinstance(o, _ForkedRanks)
                      and self._codes.get(r) is None]

    def poll(self) -> dict[int, int | None]:
        """rank -> exit code, or None while running. Reaps exited ranks."""
        told = {id(f): f.poll() for f in self._forked_owners()}
        for rank, owner in self._owner.items():
            if self._codes.get(rank) is None:
                self._codes[rank] = told[id(owner)].get(rank) if isinstance(owner, _ForkedRanks) else owner.exitcode
        return dict(self._codes)

    def collect_exited(self, run_dir: str, known: set[int]) -> dict[int, int]:
        """Ranks (not in ``known``) that exited since the last call -> exit code.

        What a rank left in its process group (a DataLoader worker it never joined) is killed
        before the rank is reaped, while its pid, the group's id, is still reserved (the template
        does this itself for the ranks it forked).
        """
        recorded = None
        for rank, owner in list(self._owner.items()):
            if rank in known or isinstance(owner, _ForkedRanks) or self._codes.get(rank) is not None:
                continue
            pid = self._pids[rank]
            if not _exited_unreaped(pid):
                continue
            if recorded is None:
                recorded = set(read_pids(run_dir).values())
            if pid in recorded:  # it reached setsid: it leads its own group
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
        # One poll for every rank (this runs on each tick of the monitor): it reaps what exited.
        return {r: c for r, c in self.poll().items() if r not in known and c is not None}

    def leaders(self) -> list[int]:
        """What a stop signals first: every rank's group."""
        return [pid for rank, pid in self._pids.items() if self._codes.get(rank) is None]

    def close(self) -> None:
        """Release the handles of exited ranks (their pipes); running ones stay open."""
        codes = self.poll()
        for forked in self._forked_owners():
            if all(codes.get(r) is not None for r in forked.pids):
                forked.close()
        if all(c is not None for c in codes.values()):
            for owner in self._owner.values():
                if not isinstance(owner, _ForkedRanks):
                    with contextlib.suppress(ValueError):  # closed already
                        owner.close()
