"""How far a session cell that was stopped or failed got, in collectives per group: the point an
exported job replays it to (``%dist_export --as-ran``, :meth:`nbdist.frontend.job_world.JobWorld.replay`).

A stop that every rank obeys at the same collective (:mod:`nbdist.worker.stop_point`) leaves the
ranks' state defined by where they stopped, not by when the button was pressed: a job that runs
the cell's code again, each rank raising before the collective it stopped before in the session,
ends in the same state (for code that draws the same numbers each time, as seeded training does).
A failed cell is replayed the same way: the rank that raised raises again; a peer that the session
released from a collective stops before it, since it never completed.

Each rank says how many collectives each group issued in the cell; a group's collective completes
only where every member issued it, so the fewest any member issued is how many completed, on
every member (the kernel takes it: :class:`nbdist.session.cell_history.CellRecord`): a peer released from a collective
that the failing rank never joined replays to just before it. Groups are named as torch names them
(``"0"`` for the world's), which a job that makes the same groups in the same order names alike.
Standard library only; the groups come from :mod:`nbdist.worker.reformable_groups` where a session
made them.
"""

from __future__ import annotations

import sys

__all__ = ["group_counts", "issued_in_cell", "attach_reach"]


def _groups() -> list:
    module = sys.modules.get("nbdist.worker.reformable_groups")  # no groups made: never imported
    return module.peek_groups() if module is not None else []


def group_counts() -> dict[str, int]:
    """``{group name: collectives issued}`` now (as a cell begins)."""
    return {g.getGroupName(): g.group_wide for g in _groups()}


def issued_in_cell(start: dict[str, int]) -> dict[str, int]:
    """``{group name: collectives this cell issued}`` on this rank, for each live group."""
    # A group the cell made itself started at 0.
    return {g.getGroupName(): max(0, g.group_wide - start.get(g.getGroupName(), 0)) for g in _groups()}


def attach_reach(body, start: dict[str, int], kind: str):
    """The reply's body for a cell that ended ``kind``, with ``"reached"`` added where the rank has
    groups (an interrupted cell's body may be None: a dict then)."""
    if kind not in ("interrupted", "failed") or not _groups():
        return body
    body = dict(body or {})
    body["reached"] = issued_in_cell(start)
    return body

