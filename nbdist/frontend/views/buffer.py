"""What every view shares: it collects a run's events from the monitor thread and draws them at a
bounded rate (at most ~10 times a second), holding a bounded number of lines; and the line that
says how a run ended. The views own no lifecycle: a Kill button calls the run's ``kill()``."""

from __future__ import annotations

import collections
import threading
import time

from nbdist.errors import RunStoppedError, WorkerFailedError
from nbdist.run.display_backlog import DRAW_BYTES, RECORD_DISPLAYS, DisplayBacklog, TakenDisplays
from nbdist.run.events import TERMINAL, DisplayEvent, OutputChunk, RunEvent

__all__ = ["BufferedView", "format_report_line", "FLUSH_INTERVAL", "MAX_VIEW_LINES", "MAX_BUFFERED_LINES",
           "FELL_BEHIND"]

FLUSH_INTERVAL = 0.1  # at most ~10 updates a second per rank
MAX_VIEW_LINES = 2000  # per rank; the full log stays in the run dir
# Lines a view holds between two draws, per rank. Past it the oldest go (counted, and said where
# they were): a view that can't keep up shows the end of the output, and memory stays bounded.
MAX_BUFFERED_LINES = 4 * MAX_VIEW_LINES
FELL_BEHIND = "the view fell behind"  # why a view dropped displays (TakenDisplays.dropped_note)


def format_report_line(run) -> str:
    """One line for the end of a run: what happened, how long it took, where the logs are."""
    elapsed = (run.ended or time.monotonic()) - run.started
    if run.status == "finished":
        return f"finished: {run.nprocs} ranks in {elapsed:.1f} s"
    if isinstance(run.error, WorkerFailedError):
        return f"failed: {run.error.summary()}"
    if isinstance(run.error, RunStoppedError) and run.report is not None:
        return f"{run.status}: {run.report}"
    return f"{run.status} after {elapsed:.1f} s"


class BufferedView:
    """Collect events from the monitor thread; a flusher drains them at a bounded rate."""

    _in_cell = True  # flushed by the cell that is waiting for the run (not by a --bg thread)

    def __init__(self, run):
        self.run = run
        self._lock = threading.Lock()
        self._lines: dict[int, list[tuple[str, str]]] = collections.defaultdict(list)
        self._pending: dict[int, dict[str, str]] = collections.defaultdict(dict)
        self._dropped: collections.Counter = collections.Counter()
        self._displays = DisplayBacklog(RECORD_DISPLAYS, DRAW_BYTES)  # bounded between draws, as lines are
        self._dirty_status = True
        self._ended = threading.Event()
        self._thread = None

    def on_event(self, event) -> None:
        with self._lock:
            if isinstance(event, OutputChunk):
                buffered = self._lines[event.rank]
                buffered.extend((event.stream, line) for line in event.lines)
                if len(buffered) > MAX_BUFFERED_LINES:
                    drop = len(buffered) - MAX_BUFFERED_LINES
                    del buffered[:drop]
                    self._dropped[event.rank] += drop
                self._pending[event.rank][event.stream] = event.pending
            elif isinstance(event, DisplayEvent):
                self._displays.add(event)
            elif isinstance(event, RunEvent):
                self._dirty_status = True
                if event.rank is None and event.status in TERMINAL:
                    self._ended.set()

    def take(self):
        with self._lock:
            lines, self._lines = self._lines, collections.defaultdict(list)
            dropped, self._dropped = self._dropped, collections.Counter()
            pending = {r: dict(p) for r, p in self._pending.items()}
            dirty, self._dirty_status = self._dirty_status, False
        for rank, n in dropped.items():
            lines[rank].insert(0, ("stderr", f"[nbdist: {n:,} lines not shown here, the view fell behind; "
                                             f"%dist_logs or {self.run.log_dir} has them all]"))
        return lines, pending, dirty

    def take_displays(self) -> TakenDisplays:
        """The rich output that came since the last draw (each rank's newest, bounded), and how many
        bundles were dropped because the view fell behind (``dropped_note`` says it)."""
        with self._lock:
            return self._displays.take()

    def displaying_ranks(self) -> set[int]:
        """The ranks whose rich output waits to be drawn."""
        with self._lock:
            return self._displays.ranks()

    def start_flusher(self) -> None:
        """Draw from a thread (for --bg, when no cell is waiting to do it)."""
        self._in_cell = False  # what is shown from a thread can't go into a cell's own output

        def loop():
            while not self._ended.wait(FLUSH_INTERVAL):
                self.flush()
            self.flush(final=True)

        self._thread = threading.Thread(target=loop, name="nbdist-view", daemon=True)
        self._thread.start()

    def flush(self, final: bool = False) -> None:
        raise NotImplementedError


