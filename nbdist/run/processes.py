"""Find a run's processes by their marker: ``NBDIST_RUN_ID`` in ``/proc/PID/environ``, never a name.

What ``nbdist.ps()``, ``nbdist.kill()``, the CLI and the teardown read (psutil).
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass

import psutil

from nbdist.protocol.marker import read_marker
from nbdist.protocol.registration import read_pids
from nbdist.protocol.rundir import STORE_HOST_PREFIX, TEMPLATE_PREFIX, read_spec

__all__ = ["MarkedProcess", "Owner", "find_marked", "find_owner"]


@dataclass
class MarkedProcess:
    """A live process that carries a run's marker."""

    pid: int
    run_id: str
    rank: int | None
    ppid: int
    started: float
    rss: int
    cmdline: str
    run_dir: str | None
    owner: Owner | None = None  # the kernel that started it, as its run dir says (None: no run dir)

    @property
    def age(self) -> float:
        return max(0.0, time.time() - self.started)

    @property
    def is_template(self) -> bool:
        """A kernel's own helper, not a rank of any run: its warm template (it forks ranks) or its
        store host (it hosts the runs' stores). Both live as long as their kernel."""
        return self.run_id.startswith((TEMPLATE_PREFIX, STORE_HOST_PREFIX))

    @property
    def is_store_host(self) -> bool:
        """A kernel's store host (:mod:`nbdist.launchers.store_host`)."""
        return self.run_id.startswith(STORE_HOST_PREFIX)

    @property
    def mine(self) -> bool:
        """Started by this process (a run or session of this kernel)."""
        return self.owner is not None and self.owner.local and self.owner.pid == os.getpid()

    @property
    def orphaned(self) -> bool:
        """True when the kernel that started this process is gone: a leftover nobody will end.

        A process whose run dir names no kernel (none readable here) is nobody's. A template is
        also a leftover once its kernel is no longer its parent (handed to init or a subreaper).
        A run of a kernel on another machine is that kernel's to judge: never orphaned here.
        """
        if self.owner is None:
            return True
        if self.is_template and (self.ppid <= 1 or (self.owner.pid is not None and self.owner.pid != self.ppid)):
            return True
        return self.owner.alive is False

    def whose(self) -> str:
        """Whose it is, in a few words: "this kernel", "kernel pid 4242", "orphaned (kernel pid 4242 is gone)"."""
        if self.owner is None:
            return "orphaned (no run dir names its kernel)"
        if self.mine:
            return "this kernel"
        if not self.owner.local:
            return f"kernel pid {self.owner.pid} on {self.owner.host}"
        if self.orphaned:
            return f"orphaned (kernel pid {self.owner.pid} is gone)"
        return f"kernel pid {self.owner.pid}"


@dataclass(frozen=True)
class Owner:
    """The kernel that started a run: its pid and host, and whether it still lives (None: it runs
    on another machine, which this one can't tell)."""

    pid: int | None
    host: str
    alive: bool | None

    @property
    def local(self) -> bool:
        return self.alive is not None


def find_owner(run_dir: str | None) -> Owner | None:
    """The kernel that made ``run_dir``: from its spec (runs, sessions) or ``kernel.pid`` (templates).

    It lives if its pid does and that process is older than the run dir (a younger one reused the
    number after the kernel died).
    """
    if not run_dir:
        return None
    try:
        spec = read_spec(run_dir)
        pid, host, made = spec.parent_pid, spec.kernel_host or socket.gethostname(), spec.created
    except (OSError, ValueError, TypeError):
        try:
            path = os.path.join(run_dir, "kernel.pid")
            with open(path) as fh:
                pid, host, made = int(fh.read().strip() or 0), socket.gethostname(), os.path.getmtime(path)
        except (OSError, ValueError):
            return None
    if host != socket.gethostname():
        return Owner(pid, host, None)
    try:
        alive = bool(pid) and psutil.Process(pid).create_time() <= made + 1.0
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        alive = False
    return Owner(pid, host, alive)


def find_marked(run_id: str | None = None) -> list[MarkedProcess]:
    """Live processes of this user that carry ``NBDIST_RUN_ID`` (of ``run_id``, or of any run)."""
    me, uid = os.getpid(), os.getuid()
    found, rank_maps, owners = [], {}, {}
    for proc in psutil.process_iter(["pid", "uids", "status"]):
        info = proc.info
        if info["pid"] == me or info["status"] == psutil.STATUS_ZOMBIE:
            continue
        if info["uids"] is None or info["uids"].real != uid:
            continue
        try:
            env = proc.environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            continue
        rid, run_dir = read_marker(env)  # forked ranks carry it padded (nbdist.protocol.marker)
        if not rid or (run_id is not None and rid != run_id):
            continue
        if run_dir not in rank_maps:
            rank_maps[run_dir] = {pid: rank for rank, pid in read_pids(run_dir).items()} if run_dir else {}
            owners[run_dir] = find_owner(run_dir)
        try:
            with proc.oneshot():
                found.append(
                    MarkedProcess(
                        pid=proc.pid,
                        run_id=rid,
                        rank=rank_maps[run_dir].get(proc.pid),
                        ppid=proc.ppid(),
                        started=proc.create_time(),
                        rss=proc.memory_info().rss,
                        cmdline=" ".join(proc.cmdline()),
                        run_dir=run_dir,
                        owner=owners[run_dir],
                    )
                )
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return found
