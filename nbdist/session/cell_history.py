"""A session's cells as they ran, kept for the export (:mod:`nbdist.session.job_export`).

Each user cell of an incarnation leaves a :class:`CellRecord`: its source (or function), the ranks it
ran on, the notebook names it read and where their values went, and its handle, whose status says
at export time how it ended. nbdist's own calls (bringing ranks in step, healing) and the reads that
change nothing on the ranks (``pull``, ``gather``) leave none. The notebook's own cells, which the
front end sees run in the kernel, are :class:`NotebookCell` s; they come with an export, never from here.

Standard library only; one history per incarnation: a restart's new ranks start a new one, as the
state they hold does.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field

__all__ = ["CellRecord", "NotebookCell", "CellHistory", "KEPT_VALUES_FILE"]

KEPT_VALUES_FILE = "notebook-values.nbv"  # in a cell's dir: the notebook values it got, kept past its end


@dataclass
class NotebookCell:
    """A cell the kernel itself ran (not on the ranks), as the front end saw it."""

    execution_count: int
    source: str  # as typed: magics and all
    cell_id: str | None = None  # the id JupyterLab, Notebook 7 and VS Code send with each execution
    ok: bool = True  # it ran to its end


@dataclass
class CellRecord:
    """One user cell of a session, as it was sent to the ranks."""

    number: int  # its cell dir's number within the incarnation
    ranks: list[int]  # the ranks it ran on
    every_rank: bool  # it ran on every rank of the session (no --ranks)
    # "code" (a cell's source), "function" (Session.run), "values" (push, scatter), "heal" (Session.heal:
    # it rebuilt every DDP model's reducer, whose next step issues collectives a job must issue too),
    # "sync" (Session.sync, %dist_sync: the replicas and optimizers set from one rank's)
    what: str = "code"
    source: str = ""  # code: the text the ranks ran; heal: what it healed; sync: the rank synced from
    magic_line: str = ""  # a %%distributed cell's options, as expanded when it ran
    call: tuple | None = None  # function: (fn, args, kwargs)
    value_names: list[str] = field(default_factory=list)  # values: the names it set
    notebook_values: list[str] = field(default_factory=list)  # names read from the notebook, by value
    modules: dict[str, str] = field(default_factory=dict)  # names read from the notebook: modules
    pushed_file: str | None = None  # the notebook values as sent, kept in its cell dir (None: too big to keep)
    execution_count: int | None = None  # the kernel cell that sent it (a magic's)
    cell_id: str | None = None
    status: str = "running"  # how it ended: "finished", "failed", "interrupted", "lost"
    error_line: str = ""  # a failed cell's error, its first line
    nprocs: int | None = None  # a one-shot cell: the fresh ranks it started (None: a session's cell)
    # A stopped or failed cell: {rank: {group: its collectives that completed}}, where an export replays
    # it to (nbdist.worker.cell_reach); empty where that can't be had (no groups, a rank died, a rank
    # stopped where it was). ``models_reset``: the session then reset its models' half-done step.
    reached: dict = field(default_factory=dict)
    models_reset: bool = False

    def follow(self, handle) -> CellRecord:
        """Take the cell's outcome from its handle when it ends, without keeping the handle (nor the
        values it holds: a history lives as long as the session's ranks)."""
        from nbdist.run.events import TERMINAL, RunEvent

        def on_event(event) -> None:  # a run's output chunks come this way too
            if isinstance(event, RunEvent) and event.rank is None and (event.status in TERMINAL or
                                                                        event.status == "lost"):
                self._settle(event.status, event.detail, handle)

        handle.subscribe(on_event, replay=False)
        if handle.done:  # it ended before we listened
            self._settle(handle.status, handle.error, handle)
        return self

    def _settle(self, status: str, detail, handle) -> None:
        self.status = status
        if status == "failed" and isinstance(detail, BaseException):
            line = str(detail).splitlines()[0] if str(detail) else type(detail).__name__
            self.error_line = re.sub(r" \(pid \d+\)", "", line)  # a job's header: the session's pids mean nothing there
        reached = getattr(handle, "reached", None) or {}  # a session cell's handle; a run has none
        every = set(reached) >= set(self.ranks) and not getattr(handle, "deaths", None)
        if status == "interrupted":  # replayable where every rank stopped at the agreed point
            every = every and set(handle.stopped_before) >= set(self.ranks) and not handle.stopped_anywhere
        if status in ("interrupted", "failed") and every:
            self.reached = _completed_on_every_rank({r: reached[r] for r in sorted(self.ranks)})
            self.models_reset = bool(handle.models_reset)

    @property
    def label(self) -> str:
        """How the export's header names it: the notebook's ``In [n]``, or the session's cell number."""
        if self.what == "heal":
            return f"the heal ({self.source})"
        if self.what == "sync":
            return f"the re-sync from rank {self.source} (%dist_sync)"
        if self.execution_count is not None:
            return f"In [{self.execution_count}]"
        return f"one-shot cell {self.number}" if self.nprocs is not None else f"session cell {self.number}"


def _completed_on_every_rank(issued: dict[int, dict[str, int]]) -> dict[int, dict[str, int]]:
    """``{rank: {group: collectives that completed}}`` from what each rank issued in a cell: a
    group's collective completes only where every member issued it, so per group the fewest any
    member issued (a peer released from one its failing peer never joined stops just before it)."""
    fewest: dict[str, int] = {}
    for counts in issued.values():
        for group, n in counts.items():
            fewest[group] = min(fewest.get(group, n), n)
    return {rank: {group: fewest[group] for group in counts} for rank, counts in issued.items()}


class CellHistory:
    """The user cells of one incarnation, in the order they were sent."""

    def __init__(self):
        self._lock = threading.Lock()
        self._records: list[CellRecord] = []

    def add(self, record: CellRecord) -> CellRecord:
        with self._lock:
            self._records.append(record)
        return record

    def records(self) -> list[CellRecord]:
        with self._lock:
            return list(self._records)

    def __len__(self) -> int:
        return len(self._records)
