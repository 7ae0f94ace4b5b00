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

from nbdist.launchers.processes import is_gone, is_zombie
from nbdist.run.processes import find_marked

__all__ = ["StopReport", "list_descendants", "signal_group", "stop_tree"]


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
            if pid not in cleared and is_zombie(pid):
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
