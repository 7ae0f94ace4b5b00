"""What a run (or a session's cell) tells its subscribers: rank states, output chunks, rich output,
its end; and the replay a late subscriber (a view) gets first.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

__all__ = ["RankStatus", "RunEvent", "OutputChunk", "DisplayEvent", "EventSource", "TERMINAL", "EXITS_TIED_S"]

# Exits seen closer than this were found in one look (a reader or a monitor tick behind an engine that
# took a dead rank's peers down at once): which went first is not known. One rule for every reader of them.
EXITS_TIED_S = 0.05

log = logging.getLogger("nbdist.run")


@dataclass
class OutputChunk:
    """New output of one rank's stream: finished lines, plus the line still being written."""

    rank: int
    stream: str  # "stdout" or "stderr"
    lines: list[str]
    pending: str  # the unfinished last line after \r handling ("" when none)
    time: float = field(default_factory=time.time)


@dataclass
class DisplayEvent:
    """Rich output of one rank (a ``display(...)`` or a figure): a MIME bundle, as a kernel sends it."""

    rank: int
    data: dict
    metadata: dict = field(default_factory=dict)


TERMINAL = ("finished", "failed", "interrupted", "killed")


@dataclass
class RankStatus:
    """A rank's state, as the views show it."""

    rank: int
    status: str = "starting"
    pid: int | None = None
    exitcode: int | None = None
    signal_name: str | None = None
    started: float = field(default_factory=time.monotonic)
    ended: float | None = None
    where: str | None = None  # a rank paused in the debugger: where it stands

    @property
    def elapsed(self) -> float:
        return (self.ended or time.monotonic()) - self.started


@dataclass
class RunEvent:
    """The run or one of its ranks changed state. ``rank`` is None for the run itself."""

    status: str
    rank: int | None = None
    detail: object = None


class EventSource:
    """Subscribers, and what a late one is sent first: the lines kept, the rank states, the end.

    What a view subscribes to: a :class:`Run`, or a session's cell (:mod:`nbdist.session.cell_handle`).
    """

    def _replay(self, callback, lines_by_rank: dict, extra=()) -> None:
        for rank, lines in lines_by_rank.items():
            by_stream: dict[str, list[str]] = {}
            for stream, line in list(lines):
                by_stream.setdefault(stream, []).append(line)
            for stream, chunk in by_stream.items():
                callback(OutputChunk(rank, stream, chunk, ""))
        for event in extra:
            callback(event)
        for r, st in self.ranks.items():
            callback(RunEvent(st.status, self.global_rank(r), st))
        if self.done:
            callback(RunEvent(self.status, None, self.error or self.report))

    def _wait_until_done(self, timeout: float | None) -> None:
        """Block until done. KeyboardInterrupt interrupts (then propagates); ``timeout`` only limits
        the wait: on expiry TimeoutError is raised and the work goes on."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while not self._done.wait(0.1):
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"{self.label} still {self.status} after {timeout} s")
        except KeyboardInterrupt:
            self.interrupt()
            raise

    def _emit(self, event) -> None:
        for cb in list(self._subscribers):
            try:
                cb(event)
            except Exception:  # a broken view must never stop the bookkeeping
                log.exception("nbdist view callback failed")
