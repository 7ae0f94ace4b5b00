"""Find a run's processes by their marker: ``NBDIST_RUN_ID`` in ``/proc/PID/environ``, never a name.

What ``nbdist.ps()``, ``nbdist.kill()``, the CLI and the teardown read (psutil).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import psutil

from nbdist.protocol.marker import read_marker
from nbdist.protocol.rundir import TEMPLATE_PREFIX, read_pids

__all__ = ["MarkedProcess", "find_marked"]


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

    @property
    def age(self) -> float:
        return max(0.0, time.time() - self.started)

    @property
    def is_template(self) -> bool:
        """A kernel's warm template (it forks ranks; it is not a rank of any run)."""
        return self.run_id.startswith(TEMPLATE_PREFIX)

    @property
    def orphaned(self) -> bool:
        """True when the kernel that started this process is no longer its parent.

        A template is legitimate only while its kernel lives (PDEATHSIG normally ends it with the
        kernel); one handed to init or a subreaper is a leftover to kill. The kernel's pid is in
        the template's run dir, so a subreaper that adopted it is not taken for its kernel.
        """
        owner = None
        if self.run_dir:
            try:
                with open(os.path.join(self.run_dir, "kernel.pid")) as fh:
                    owner = int(fh.read().strip() or 0)
            except (OSError, ValueError):
                pass
        if self.ppid <= 1 or (owner is not None and owner != self.ppid):
            return True
        try:
            return psutil.Process(self.ppid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True


def find_marked(run_id: str | None = None) -> list[MarkedProcess]:
    """Live processes of this user that carry ``NBDIST_RUN_ID`` (of ``run_id``, or of any run)."""
    me, uid = os.getpid(), os.getuid()
    found, rank_maps = [], {}
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
                    )
                )
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return found
