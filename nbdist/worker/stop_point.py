"""A stop that every rank of a session obeys at the same point: between the same two collectives.

A KeyboardInterrupt that the stop button raises on each rank lands wherever each rank happens to
be. One rank may have taken its optimizer step and its peer not: the replicas drift apart, and
nothing says so until the loss does. So a stop first asks the ranks where they are, as the group
sequence numbers of their flight recorders (:mod:`nbdist.worker.flight_recorder`) count it:

1. The kernel writes the stop request into the cell's dir and sends STOP_POINT_SIGNAL. The rank's
   signal thread closes the gate (:func:`claim` now waits instead of handing out the next number),
   then writes how many collectives each of its groups issued (:func:`report_counts`).
2. The kernel takes the highest count per group as the stop point, writes it, and signals again.
   :func:`load_point` opens the gate up to that point: a rank behind it issues the collectives its
   peers already did; the first one beyond it raises :class:`StoppedAtCollective` instead. Every rank
   thus stops between the same two collectives, as an exception raised there (which unwinds ``with``
   blocks and ``finally``s as any exception does).

A rank that reaches no further collective within the kernel's window (a loop without collectives,
a long compute) gets today's SIGINT where it is, and the cell says that its replicas may differ.
The gate and the counts share one lock, so a collective is either counted in the report or waits
for the point: no rank slips one past the point it reported. Point-to-point ops are not gated (a
send's peer is one rank, not the group). Standard library only; the groups are passed in.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from dataclasses import dataclass, field

from nbdist.worker.import_guard import importing_in_cell

__all__ = ["StoppedAtCollective", "POINT_WAIT_S", "begin_cell", "arm", "end_cell", "claim", "report_counts", "load_point",
           "was_hit", "take_hit"]

# How long a rank waits at the closed gate for the kernel's point; past it the stop wins anyway.
POINT_WAIT_S = 1.5
_POINT_TO_POINT = ("send", "recv", "recv_anysource")
_API_NAMES = {"allreduce": "all_reduce", "allgather": "all_gather", "_allgather_base": "all_gather_into_tensor",
              "_reduce_scatter_base": "reduce_scatter_tensor", "alltoall_base": "all_to_all_single"}


class StoppedAtCollective(KeyboardInterrupt):
    """The stop button, raised as the rank was about to issue a collective beyond the stop point
    that every rank agreed on. A KeyboardInterrupt, so ``except Exception`` in user code doesn't
    swallow it; and every later collective of the cell raises it again."""


@dataclass
class _Stop:
    """The stop of one cell, as this rank knows it (one per cell: a new cell never sees an old one)."""

    cell_dir: str
    point: dict | None = None  # group name -> the last collective number the rank may issue
    anywhere: bool = False  # the kernel gave up agreeing: stop at the next collective, whatever its number
    known: threading.Event = field(default_factory=threading.Event)
    hit: str | None = None  # the collective the rank stopped before


_LOCK = threading.Lock()  # the gate and the counts: a collective is counted in the report, or waits
_STOP: _Stop | None = None
_CELL_STARTED = 0.0


def begin_cell() -> None:
    """A cell starts: no stop is pending (a late signal of the last cell's stop can't reach this one)."""
    global _STOP, _CELL_STARTED
    with _LOCK:
        _STOP, _CELL_STARTED = None, time.time()


def arm(point: dict) -> None:
    """A stop agreed before the code runs: the first collective beyond ``point`` (``{group name:
    the last collective number it may issue}``) raises. An exported job replays a cell that was
    stopped in the session to where it stopped there (:mod:`nbdist.worker.cell_reach`)."""
    global _STOP
    with _LOCK:
        _STOP = _Stop("replay", point=dict(point))
        _STOP.known.set()


def end_cell() -> None:
    global _STOP
    with _LOCK:
        _STOP = None


def claim(group, op: str) -> int:
    """The gate, on the group's forwarding: the number of ``op``, the group's next collective,
    counted now; or :class:`StoppedAtCollective` when it lies beyond the agreed stop point. While
    the kernel agrees the point, wait for it (at most :data:`POINT_WAIT_S`; the stop wins then)."""
    waited = None
    while True:
        with _LOCK:
            stop = _STOP
            seq = group.group_wide + 1
            if stop is None or (stop.point is not None and not stop.anywhere
                                and seq <= stop.point.get(group.getGroupName(), seq)):
                group.group_wide = seq
                return seq
            if stop.point is not None or stop.anywhere or (waited is not None and time.monotonic() > waited):
                stop.hit = stop.hit or f"{_API_NAMES.get(op, op)} #{seq} on {group.label}"
                raise StoppedAtCollective(f"stopped before {stop.hit}, where every rank stops")
            known = stop.known
        if waited is None:
            waited = time.monotonic() + POINT_WAIT_S
        known.wait(max(0.0, waited - time.monotonic()) + 0.01)


def report_counts(cell_dir: str, path: str, rank: int, groups, recent) -> bool:
    """On the signal thread: close the gate for the cell ``cell_dir`` and write this rank's counts.

    ``groups``: the rank's live re-formable groups; ``recent``: its flight recorder's collectives
    (their start times tell the kernel how long it may wait for the next one). False when it had
    reported already (the second signal carries the point)."""
    global _STOP
    with _LOCK:
        if _STOP is not None and _STOP.cell_dir == cell_dir:
            return False
        _STOP = _Stop(cell_dir)
        counts = {g.getGroupName(): g.group_wide for g in groups}
    starts = [c.started for c in recent if c.started >= _CELL_STARTED]
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    now = time.time()
    # Issued and not completed: in C, most likely (gloo's send and recv give no future: "issued").
    waiting = [c.started for c in recent if c.state == "waiting" or (c.state == "issued" and c.op in _POINT_TO_POINT)]
    report = {"rank": rank, "counts": counts, "collectives": len(starts), "gap": max(gaps, default=None),
              "since_last": now - starts[-1] if starts else now - _CELL_STARTED,
              "waiting_s": now - min(waiting) if waiting else None,
              # A cell's import can't be stopped inside (nbdist.worker.import_guard): the kernel waits longer.
              "importing": importing_in_cell(sys._current_frames().get(threading.main_thread().ident)),
              # A rank inside an optimizer's step, or a step short of a peer's, computes towards the
              # point (a first Adam step, slow): the kernel waits as for a rank behind it.
              "optimizer_steps": _optimizer_steps()}
    from nbdist.protocol.rundir import write_private

    write_private(path, json.dumps(report).encode())
    return True


def _optimizer_steps() -> dict:
    """``{optimizer number: [steps in this cell, inside one now]}``, read from the signal thread."""
    from nbdist.worker.optimizer_steps import steps_this_cell

    try:
        return {str(n): [steps, inside] for n, (steps, inside) in steps_this_cell().items()}
    except RuntimeError:  # the main thread made an optimizer as this read them: none to go by
        return {}


def load_point(cell_dir: str, path: str) -> bool:
    """On the signal thread: open the gate up to the point the kernel wrote (``{"point": {group:
    number}}``, or ``{"point": null}``: stop at the next collective). False if it isn't there yet."""
    try:
        with open(path, "rb") as fh:
            point = json.loads(fh.read()).get("point")
    except (OSError, ValueError):
        return False
    with _LOCK:
        stop = _STOP
        if stop is None or stop.cell_dir != cell_dir or stop.known.is_set():
            return False
        stop.point, stop.anywhere = dict(point or {}), point is None
        stop.known.set()
    return True


def was_hit() -> bool:
    """Whether this cell stopped at the agreed point (its error, whatever type it took, is the stop's)."""
    stop = _STOP
    return stop is not None and stop.hit is not None


def take_hit() -> str | None:
    """The collective this rank stopped before (``all_reduce #57 on the default group``), if any."""
    stop = _STOP
    return None if stop is None else stop.hit

