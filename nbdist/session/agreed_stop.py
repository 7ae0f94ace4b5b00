"""The kernel's half of a stop that every rank obeys at the same collective.

The stop button used to be a SIGINT to every busy rank, which lands wherever each rank happens to
be: one rank past its optimizer step, its peer not. Now the kernel first agrees a stop point with
the ranks (:mod:`nbdist.worker.stop_point` has the rank's half and the why):

1. STOP_POINT_SIGNAL to every busy rank: each closes its gate and writes how many collectives each
   of its groups issued. Counts come from the rank's signal thread, so a rank waiting in C code
   answers too.
2. The point is the highest count per group. The kernel writes it and signals again; each rank
   raises as it is about to issue a collective beyond it. Ranks behind the point catch up first.
3. Ranks that reach no collective within the window (a loop without collectives, a long compute)
   get the SIGINT where they are, as before, and the cell says which replicas may differ. A rank
   behind the point gets a longer window: its peers already issued what it computes towards; so
   does one inside an optimizer's step (stopped there, its update would be half applied), and the
   ranks still on their way once a peer stopped at the point (:func:`await_stop_point`).

The window follows the cell's own pace (a few of its longest gaps between collectives), within
:data:`WINDOW_MIN_S` and :data:`WINDOW_MAX_S`, so that a stop still reaches idle within 2 s. Only
for ranks this kernel can signal: a session with ranks on other machines stops as before.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass, field

from nbdist.protocol import rundir
from nbdist.protocol.session_channel import STOP_COUNTS_FILE, STOP_POINT_FILE, STOP_REQUEST
from nbdist.protocol.signals import STOP_POINT_SIGNAL

__all__ = ["AgreedStop", "agree_stop_point", "await_stop_point", "REPORT_WITHIN_S", "WINDOW_MIN_S", "WINDOW_MAX_S",
           "STUCK_WAIT_S", "IMPORT_WINDOW_S", "BEHIND_WINDOW_S"]

REPORT_WITHIN_S = 0.3  # a rank's signal thread answers in ms; one that doesn't in this is not agreed with
WINDOW_MIN_S = 0.05  # a cell that issued no collective yet is not likely to: stop it soon
WINDOW_MAX_S = 1.0  # with the release after it (0.5 s), a rank stuck in C is idle within 2 s
STUCK_WAIT_S = 0.1  # every busy rank waits in a collective at least this long: none will move
# A rank whose cell is inside an import can't be stopped there (nbdist.worker.import_guard): it gets
# this long to finish it (a first optimizer step imports torch._dynamo: 2 s on a busy 2-core box)
# and reach the point, where it stops with its peers instead of where it was.
IMPORT_WINDOW_S = 5.0
# A rank behind the point computes towards a collective its peers already issued: it will get
# there, only later than the cell's pace says where that compute is a first step (Adam's lazy state,
# FSDP's first all-gathers: soak seed 483411490). Half a second, so a stop is still idle within 2 s.
BEHIND_WINDOW_S = 0.5
_GAPS = 3.0  # wait for the next collective this many of the cell's longest gaps between two
_POLL_S = 0.005


@dataclass
class AgreedStop:
    """The point every rank stops at, and how long the kernel waits for them to reach it."""

    point: dict  # group name -> the last collective number a rank may issue
    window: float  # seconds the ranks get to reach it, from the point's publication
    counts: dict = field(default_factory=dict)  # rank -> its counts when asked (for messages)
    seconds: float = 0.0  # how long agreeing took

    def behind(self, ranks) -> list[int]:
        """Those of ``ranks`` whose counts, when asked, had not reached the point in some group."""
        return [r for r in ranks if r in self.counts
                and any(self.counts[r].get(g, 0) < p for g, p in self.point.items())]


def agree_stop_point(inc, cell) -> AgreedStop | None:
    """Agree the stop point with ``cell``'s busy ranks; None where no agreement can be had (the
    caller then stops them where they are): ranks elsewhere, no signals, no process group, or a
    rank that didn't report in time. In every case the stop request is in the cell's dir after this."""
    started = time.monotonic()
    with contextlib.suppress(OSError):  # first: the rank's signal thread answers only a stop of its cell
        rundir.write_private(os.path.join(cell.cell_dir, STOP_REQUEST), b"")
    busy = cell.busy_ranks()
    if STOP_POINT_SIGNAL is None or not busy or inc.remote or inc.world is not None:
        return None
    _signal(inc, busy)
    reports = _read_reports(inc, cell, busy)
    if reports is None or not any(r["counts"] for r in reports.values()):
        _publish(inc, cell, None)  # a rank whose gate closed stops at its next collective
        return None
    point: dict = {}
    for report in reports.values():
        for group, count in report["counts"].items():
            point[group] = max(point.get(group, 0), count)
    _publish(inc, cell, point)
    return AgreedStop(point, _window(reports, point), {r: rep["counts"] for r, rep in reports.items()},
                      time.monotonic() - started)


def await_stop_point(cell) -> bool:
    """Wait the agreed window for ``cell``'s ranks to stop at the point (True: every rank answered).
    Where a rank got there and its peers still compute, they get :data:`BEHIND_WINDOW_S` in all:
    they run the same code towards the point it reached, only slower (a busy box: soak, under a CPU
    hog, ranks 0,2 stopped inside an FSDP2 optimizer step 0.074 s after rank 1 stopped at the point,
    and the replicas drifted). The window then says what it became."""
    agreed, published = cell.agreed, time.monotonic()
    if cell.answered.wait(agreed.window):
        return True
    if agreed.window <= 0 or agreed.window >= BEHIND_WINDOW_S:
        return False  # no rank can move; or the longer window already
    if not set(agreed.counts) - set(cell.busy_ranks()):
        return False  # nobody got there: nothing says the others are on their way
    agreed.window = BEHIND_WINDOW_S
    return cell.answered.wait(max(0.0, published + BEHIND_WINDOW_S - time.monotonic()))


def _signal(inc, ranks) -> None:
    for pid in inc.local_pids(ranks):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, STOP_POINT_SIGNAL)


def _read_reports(inc, cell, ranks) -> dict | None:
    """``{rank: report}`` of every rank still busy, or None if one didn't answer within
    :data:`REPORT_WITHIN_S`. A rank that answered its cell meanwhile (it ended) has nothing to say."""
    paths = {r: os.path.join(cell.cell_dir, STOP_COUNTS_FILE.format(rank=r)) for r in ranks}
    reports: dict = {}
    deadline = time.monotonic() + REPORT_WITHIN_S
    while True:
        busy = set(cell.busy_ranks())
        for rank, path in list(paths.items()):
            if rank not in busy:
                paths.pop(rank)
                continue
            with contextlib.suppress(OSError, ValueError):
                with open(path, "rb") as fh:
                    reports[rank] = json.loads(fh.read())
                paths.pop(rank)
        if not paths:
            return reports
        if time.monotonic() > deadline or inc.ended:
            return None
        time.sleep(_POLL_S)


def _publish(inc, cell, point: dict | None) -> None:
    """Write the point (None: no agreement, stop at the next collective) and tell the ranks."""
    with contextlib.suppress(OSError):
        rundir.write_private(os.path.join(cell.cell_dir, STOP_POINT_FILE), json.dumps({"point": point}).encode())
        _signal(inc, cell.busy_ranks())


def _window(reports: dict, point: dict) -> float:
    """How long to wait for the ranks to reach the point: a few of the cell's longest gaps between
    two collectives (its own pace), bounded both ways; none when every rank has waited a while in
    an op that has not completed (each in a recv, or left by a peer that raised): no rank can move;
    :data:`IMPORT_WINDOW_S` when a rank's cell is inside an import; at least :data:`BEHIND_WINDOW_S`
    when a rank is behind the point, or inside (or a step short in) an optimizer's step."""
    if all(r.get("waiting_s") is not None and r["waiting_s"] >= STUCK_WAIT_S for r in reports.values()):
        return 0.0
    if any(r.get("importing") for r in reports.values()):
        return IMPORT_WINDOW_S
    behind = any(any(r["counts"].get(g, 0) < p for g, p in point.items()) for r in reports.values())
    least = BEHIND_WINDOW_S if behind or _stepping_apart(reports) else WINDOW_MIN_S
    if not any(r.get("collectives") for r in reports.values()):
        return least
    gaps = [r["gap"] for r in reports.values() if r.get("gap") is not None]
    pace = max(gaps, default=WINDOW_MIN_S)
    return min(WINDOW_MAX_S, max(least, _GAPS * pace))


def _stepping_apart(reports: dict) -> bool:
    """Whether a rank is inside an optimizer's step, or has taken fewer steps in the cell than a peer:
    it computes towards the point without a collective to show for it (FSDP2's step is local; soak
    seed 559694983: ranks in their first Adam step got :data:`WINDOW_MIN_S`, and stopped inside it)."""
    steps = [r.get("optimizer_steps") or {} for r in reports.values()]
    if any(inside for s in steps for _, inside in s.values()):
        return True
    return len({tuple(sorted((n, taken) for n, (taken, _) in s.items())) for s in steps}) > 1
