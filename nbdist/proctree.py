"""Process-tree mechanism on psutil: find what a run owns and stop all of it against one deadline.

Two ways to find a run's processes, used together:

* the tree: each rank leads its own process group (it calls ``setsid``), so a DataLoader
  worker forked by the rank is signalled with the rank's group;
* the marker: every process of a run carries ``NBDIST_RUN_ID`` in its environment, which
  also finds a grandchild that left the group (``start_new_session=True``) or whose rank died.

Nothing is ever found or killed by name.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field

import psutil

from .marker import read_marker
from .payload import TEMPLATE_PREFIX, read_pids

__all__ = [
    "MarkedProcess",
    "StopReport",
    "find_marked",
    "list_descendants",
    "is_gone",
    "signal_group",
    "stop_tree",
]


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


@dataclass
class StopReport:
    """What a stop did: how many ranks and other processes ended, with which signal, how fast."""

    ranks: int = 0
    children: int = 0
    seconds: float = 0.0
    last_signal: str | None = None
    survivors: list[int] = field(default_factory=list)

    def __str__(self) -> str:
        kids = f" and {self.children} child process{'es' if self.children != 1 else ''}" if self.children else ""
        text = f"{self.ranks} rank{'s' if self.ranks != 1 else ''}{kids} stopped in {self.seconds:.1f} s"
        if self.survivors:
            text += f"; still alive: pids {self.survivors}"
        return text


def is_gone(pid: int) -> bool:
    """A pid is gone when it no longer exists or is a zombie (it holds no memory, no GPU, no port)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return True


def _is_zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def list_descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def signal_group(pid: int, sig: int) -> bool:
    """Signal ``pid``'s process group if ``pid`` leads one, else ``pid`` alone.

    Tolerates only "no such process": anything else (EPERM on a pid someone else reused) is real.
    """
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


def _signal_pid(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


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
        rid, run_dir = read_marker(env)  # forked ranks carry it padded (nbdist.marker)
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


def _stage_budgets(signals, total: float) -> list[float]:
    """Split one deadline over the ladder: patient with SIGINT, quick with SIGTERM, the rest for SIGKILL."""
    weights = {signal.SIGINT: 0.5, signal.SIGTERM: 0.3, signal.SIGKILL: 0.2}
    w = [weights.get(s, 0.3) for s in signals]
    return [total * x / sum(w) for x in w]


def stop_tree(
    leaders,
    run_id: str | None,
    signals=(signal.SIGINT, signal.SIGTERM, signal.SIGKILL),
    timeout: float = 5.0,
    poll: float = 0.02,
    on_tick=None,
) -> StopReport:
    """Stop the group of each leader pid and every process marked with ``run_id``.

    Climbs ``signals`` against one monotonic deadline of ``timeout`` seconds: each step is sent
    only to what is still alive, and the next step comes when that step's share of the deadline
    is spent. ``on_tick`` is called while waiting so the caller can reap its own children.
    """
    t0 = time.monotonic()
    deadline = t0 + timeout
    leaders = [p for p in leaders if p]
    others: set[int] = set()
    for pid in leaders:
        others.update(p.pid for p in list_descendants(pid))
    if run_id is not None:
        others.update(m.pid for m in find_marked(run_id))
    others.difference_update(leaders)
    report = StopReport(ranks=sum(not is_gone(p) for p in leaders))
    report.children = sum(not is_gone(p) for p in others)

    cleared: set[int] = set()

    def alive() -> list[int]:
        # A leader that exited leaves its group without a reason to wait (a DataLoader worker
        # ignores SIGINT and lingers for seconds): clear that group now, while the leader is a
        # zombie and its pid, the group's id, can't have been reused. Only then reap.
        for pid in leaders:
            if pid not in cleared and _is_zombie(pid):
                cleared.add(pid)
                try:
                    os.killpg(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        if on_tick is not None:
            on_tick()
        return [p for p in (*leaders, *others) if not is_gone(p)]

    budgets = _stage_budgets(signals, timeout)
    stage_end = t0
    for sig, budget in zip(signals, budgets):
        if not alive():
            break
        report.last_signal = signal.Signals(sig).name
        for pid in leaders:
            if not is_gone(pid):
                signal_group(pid, sig)
        # Late arrivals: a grandchild forked after the snapshot, or one that left the group.
        if run_id is not None:
            fresh = {m.pid for m in find_marked(run_id)} - set(leaders)
            report.children += len(fresh - others)
            others |= fresh
        for pid in others:
            if not is_gone(pid):
                _signal_pid(pid, sig)
        stage_end = min(deadline, stage_end + budget) if sig != signals[-1] else deadline
        while time.monotonic() < stage_end and alive():
            time.sleep(poll)
    report.survivors = alive()
    report.seconds = time.monotonic() - t0
    return report
